"""The retrain DAG's approval task: Airflow's human-in-the-loop operator, asking the people
params.yaml names (``canary.approval.approvers``) and, with ``four_eyes``, never the run's own
triggering user.

Airflow 3.3 lets only a task's assigned users answer it (the API server asks the auth manager's
``is_authorized_hitl_task``: a 403 for anyone else, in the UI and the REST API alike); it has no
assigned roles. So the task assigns the approvers less whoever triggered the run, and that user's
answer is refused: the question keeps waiting for another approver, and no answer in time takes
the default, Roll back. Where Airflow cannot enforce it (no approvers listed: everyone may answer;
an auth manager that lets everyone answer, ``simple_auth_manager_all_admins``; user ids that are
not the names runs record), an answer by the triggering user that Airflow accepted fails the task
here: deploy_finish does not run, and the teardown (release_hold) rolls the held rollout back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.providers.standard.operators.hitl import HITLOperator
from airflow.sdk.exceptions import AirflowFailException

if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow.sdk.execution_time.hitl import HITLUser


def respondents(approvers: Sequence[HITLUser], triggered_by: str | None, four_eyes: bool) -> list[HITLUser]:
    """Who may answer the run's question: the approvers, less the run's triggering user with
    ``four_eyes``. Fails the task with one line when that leaves nobody (it would wait for an
    answer nobody can give)."""
    if not (four_eyes and triggered_by):
        return list(approvers)
    others = [user for user in approvers if triggered_by not in (user["id"], user["name"])]
    if approvers and not others:
        raise AirflowFailException(
            f"canary.approval.approvers {[user['id'] for user in approvers]}: {triggered_by} triggered this run "
            "and canary.approval.four_eyes asks another person to approve it: nobody can; the held rollout is "
            "rolled back (release_hold)")
    return others


def refused(responded_by: HITLUser | None, triggered_by: str | None, four_eyes: bool) -> str | None:
    """Why an answer does not count (None: it does): with ``four_eyes``, it came from the user who
    triggered the run. The timeout's default (nobody answered) always counts."""
    if not (four_eyes and triggered_by and responded_by):
        return None
    if triggered_by not in (responded_by["id"], responded_by["name"]):
        return None
    return (f"the answer of {responded_by['name']} is refused: they triggered this run and "
            "canary.approval.four_eyes asks another person to approve it; the held rollout is rolled back "
            "(release_hold)")


class RolloutApproval(HITLOperator):
    """:class:`HITLOperator` answered by ``approvers`` (Airflow user ids; empty: anyone who may
    edit the DAG) and, with ``four_eyes``, never by the user who triggered the run."""

    def __init__(self, *, approvers: Sequence[str], four_eyes: bool, **kwargs: Any) -> None:
        users: list[HITLUser] = [{"id": user, "name": user} for user in approvers]
        super().__init__(assigned_users=users or None, **kwargs)
        self.four_eyes = four_eyes

    def execute(self, context: Context) -> Any:
        self.assigned_users = respondents(self.assigned_users or [], triggered_by(context), self.four_eyes) or None
        return super().execute(context)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        answer = super().execute_complete(context, event)
        why = refused(event.get("responded_by_user"), triggered_by(context), self.four_eyes)
        if why:
            raise AirflowFailException(why)  # not retried: a retry would ask again, past approval.timeout_s
        return answer


def triggered_by(context: Context) -> str | None:
    """The user who triggered the run: the REST API's or the UI's user, the CLI's OS user; None for
    a scheduled or an asset-triggered run."""
    return context["dag_run"].triggering_user_name
