"""The library the steps share: storage URIs, params, step runner, data and model code."""
