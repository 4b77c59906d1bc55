// Validates the Gateway API objects of a JSON array file (argv[2]) against the schemas that
// @kubernetes-models/gateway-api generates from the Gateway API CRDs; prints one line per
// object and exits non-zero if any is invalid.
import { readFileSync } from "node:fs";
import { HTTPRoute } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute";

const models = { "gateway.networking.k8s.io/v1/HTTPRoute": HTTPRoute };
let failed = 0;
for (const object of JSON.parse(readFileSync(process.argv[2], "utf8"))) {
  const key = `${object.apiVersion}/${object.kind}`;
  const Model = models[key];
  try {
    if (!Model) throw new Error(`no schema for ${key}`);
    new Model(object).validate();
    console.log(`valid ${key} ${object.metadata?.name}`);
  } catch (error) {
    failed += 1;
    console.log(`INVALID ${key} ${object.metadata?.name}: ${error.message}`);
  }
}
process.exit(failed ? 1 : 0);
