"""The policy node's services and Act action, served by the policy node itself.

``~/act``, ``~/start_episode``, ``~/end_episode``, ``~/interrupt`` and ``~/label`` belong to the node
(``ros2 node info`` lists them). The callbacks block on gRPC (begin, label) or wait for an episode to
end (the Act goal), so they run in a reentrant callback group of their own, served by the node's
MultiThreadedExecutor (``seq-services``, :mod:`.executors`), apart from the observation callbacks (on
their own SingleThreadedExecutor) and the lifecycle services (their own group). Goals are accepted
only while the node is active (lifecycle).

Errors become responses: a contract or action-space refusal is reason 'validate' (Act) or
``accepted: false`` with the message (StartEpisode); a second goal while one runs is rejected and
the rejection logged; a second StartEpisode is refused with a message.

While a goal runs its status is published again with each feedback (``_republish_status``), so a client that
missed the first status still sends its cancel on Ctrl-C. A goal whose client goes away without cancelling
is interrupted (:class:`GoalClientWatch`): every action client subscribes to the action's feedback topic, so
when every subscriber seen during the goal has left the ROS graph (a killed script, a command line that died
before its cancel went out), nobody is left to cancel it, and the arm holds instead of running to
``max_seconds``.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import CallbackGroup
from rclpy.node import Node
from sequence_ai_msgs.action import Act
from sequence_ai_msgs.srv import EndEpisode, Label, StartEpisode
from std_srvs.srv import Trigger

from sequence_ai_ros.exceptions import ConfigError, ContractViolation, SequenceAIError
from sequence_ai_ros.node.runner import EpisodeCounts, EpisodeReport, Runner, episode_settings

#: Reasons that end an Act goal as succeeded; the others abort it (interrupted: canceled if asked).
SUCCESS_REASONS = ('completed', 'until', 'timeout')
FEEDBACK_PERIOD_S = 0.2
#: How often a running goal looks for its client on the ROS graph (s).
CLIENT_CHECK_PERIOD_S = 0.1


class GoalClientWatch:
    """Tells when every possible client of a running goal has left the ROS graph.

    rclpy's action server does not say which client sent a goal, but every action client subscribes to the
    action's feedback topic. The watch keeps the feedback subscribers seen while the goal runs (node and
    endpoint GID) and reports the goal orphaned once none of them is on the graph any more. A client that is
    still there (also another observer of the same action) keeps the goal running; its bound is then
    ``max_seconds``, as always. Discovery on the node's side may lag the goal: nothing is decided before a
    subscriber has been seen. A client that exits cleanly leaves the graph at once; a killed one only when
    DDS drops its participant, after the participant lease (20 s by default with Fast DDS).

    :param node: the node serving the action (its graph cache answers the queries).
    :param topic: the action's fully qualified feedback topic (``<action>/_action/feedback``).
    """

    def __init__(self, node: Any, topic: str) -> None:
        self._node = node
        self._topic = topic
        self._seen: set[bytes] = set()
        self._next_check = 0.0

    def orphaned(self, now: float) -> bool:
        """Return True once every feedback subscriber seen during the goal has left (checked every 0.1 s)."""
        if now < self._next_check:
            return False
        self._next_check = now + CLIENT_CHECK_PERIOD_S
        try:
            present = {bytes(info.endpoint_gid) for info in self._node.get_subscriptions_info_by_topic(self._topic)}
        except Exception:  # a graph query that fails (context shutting down) decides nothing
            return False
        self._seen |= present
        return bool(self._seen) and not (self._seen & present)


class EpisodeHost(Protocol):
    """What the services need of the node they serve beyond its rclpy Node (:class:`.policy_node.PolicyNode`)."""

    @property
    def runner(self) -> Runner:
        """The node's current runner (a lifecycle cleanup replaces it)."""

    @property
    def lifecycle_state(self) -> str:
        """The lifecycle state's label (goals are refused naming it while the node is not active)."""


def _refusal(exc: BaseException) -> str:
    return 'validate' if isinstance(exc, (ContractViolation, ConfigError)) else 'error'


class EpisodeServices:
    """Services and the Act action of the policy node, created on that node.

    :param node: the rclpy node that serves them (``ros2 node info`` lists them there).
    :param host: the same node as the services see it: the runner the callbacks drive, its lifecycle state.
    :param group: their callback group (reentrant: the callbacks block).
    """

    def __init__(self, node: Node, host: EpisodeHost, group: CallbackGroup) -> None:
        self.node = node
        self.host = host
        self.act_server = ActionServer(node, Act, '~/act', execute_callback=self._execute,
                                       goal_callback=self._on_goal, cancel_callback=self._on_cancel,
                                       callback_group=group)
        #: The action's fully qualified name (``/robot1/policy_node/act``).
        self.act_server_name = f'{node.get_fully_qualified_name().rstrip("/")}/act'
        node.create_service(StartEpisode, '~/start_episode', self._start, callback_group=group)
        node.create_service(EndEpisode, '~/end_episode', self._end, callback_group=group)
        node.create_service(Trigger, '~/interrupt', self._interrupt, callback_group=group)
        node.create_service(Label, '~/label', self._label, callback_group=group)

    @property
    def runner(self) -> Runner:
        """The node's current runner (a lifecycle cleanup replaces it)."""
        return self.host.runner

    def get_logger(self) -> Any:
        """The node's logger."""
        return self.node.get_logger()

    def destroy(self) -> None:
        """Destroy the action server (the services go with the node)."""
        self.act_server.destroy()

    # -- Act -----------------------------------------------------------------------------------------
    def _on_goal(self, goal: Act.Goal) -> GoalResponse:
        if not self.runner.accepting:
            self.get_logger().warning(f'Act goal rejected: the node is not active (lifecycle state '
                                      f'{self.host.lifecycle_state})')
            return GoalResponse.REJECT
        ep = self.runner.episode
        if ep is not None and not ep.done.is_set():
            self.get_logger().warning(f'Act goal rejected: episode {ep.id} is running (one at a time)')
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def _on_cancel(self, _goal_handle: Any) -> CancelResponse:
        return CancelResponse.ACCEPT

    def _execute(self, goal_handle: Any) -> Act.Result:
        goal = goal_handle.request
        try:
            settings = episode_settings(goal.instruction, goal.max_seconds, max_actions=goal.max_actions,
                                        smooth_seam=goal.smooth_seam, prefetch=goal.prefetch)
            eid = self.runner.start(settings, goal.episode_id)
        except SequenceAIError as exc:
            goal_handle.abort()
            return Act.Result(reason=_refusal(exc), episode_id=goal.episode_id, message=str(exc))
        cancelled = orphaned = False
        watch = GoalClientWatch(self.node, f'{self.act_server_name}/_action/feedback')
        next_feedback = 0.0
        while True:
            result = self.runner.wait(eid, 0.02)
            if result is not None:
                break
            now = time.monotonic()
            if goal_handle.is_cancel_requested and not cancelled:
                cancelled = True
                self.runner.interrupt()
            elif not (cancelled or orphaned) and watch.orphaned(now):
                orphaned = True
                self.get_logger().warning(f'episode {eid}: the Act goal\'s client left the ROS graph without '
                                          'cancelling; interrupting (the arm holds)')
                self.runner.interrupt("the Act goal's client left the ROS graph without cancelling")
            if now >= next_feedback:
                next_feedback = now + FEEDBACK_PERIOD_S
                goal_handle.publish_feedback(self._feedback(eid))
                self._republish_status()
        out = self._result(result)
        if cancelled and goal_handle.is_cancel_requested:
            goal_handle.canceled()
        elif result.reason in SUCCESS_REASONS:
            goal_handle.succeed()
        else:
            goal_handle.abort()
        return out

    def _republish_status(self) -> None:
        """Publish the goals' status again, so a client that missed the first one knows its goal is executing.

        rclpy's action client drops a status message that arrives before it has processed the goal's response,
        and the server publishes status only on a state change: such a client then believes its goal is in no
        state, and ``ros2 action send_goal`` skips its cancel on Ctrl-C. Republishing with the feedback (5 Hz)
        closes that window. rclpy has no public call for it; without the handle's method nothing is republished.
        """
        try:
            self.act_server._handle.publish_status()
        except Exception:  # noqa: BLE001  (best effort: an rclpy without it, or a server being destroyed)
            pass

    def _feedback(self, eid: str) -> Act.Feedback:
        ep = self.runner.episode
        stats: dict[str, Any] = {}
        if self.runner.policy is not None:
            try:
                stats = dict(self.runner.policy.stats())
            except Exception:  # feedback is best effort
                stats = {}
        # the client's counts (its ledger owns them), over the time they cover: to the latest deadline they
        # count, not to now, so a control thread that has not run for a while (load), or an episode that has
        # stopped, adds no periods the counts lack
        counts = self.runner.counts() if ep is not None and ep.id == eid else EpisodeCounts()
        return Act.Feedback(episode_id=eid, commands_sent=counts.commands_sent, ticks_held=counts.ticks_held,
                            ticks_skipped=counts.ticks_skipped,
                            chunks=int(stats.get('chunks', 0)), underruns=int(stats.get('underruns', 0)),
                            buffer_s=float(stats.get('buffer_s', 0.0)), elapsed_s=counts.elapsed_s)

    @staticmethod
    def _result(r: EpisodeReport) -> Act.Result:
        return Act.Result(reason=r.reason, episode_id=r.episode_id, actions=r.actions, chunks=r.chunks,
                          underruns=r.underruns, underrun_s=float(r.underrun_s),
                          max_seam_jump=float(r.max_seam_jump), elapsed_s=float(r.elapsed_s),
                          latency_p50_ms=float(r.latency_p50_ms), latency_p95_ms=float(r.latency_p95_ms),
                          commands_sent=int(r.commands_sent), ticks_held=int(r.ticks_held),
                          ticks_skipped=int(r.ticks_skipped), message=r.message)

    # -- services ------------------------------------------------------------------------------------
    def _start(self, req: StartEpisode.Request, resp: StartEpisode.Response) -> StartEpisode.Response:
        try:
            settings = episode_settings(req.instruction, req.max_seconds, max_actions=req.max_actions)
            resp.episode_id = self.runner.start(settings, req.episode_id)
            resp.accepted, resp.message = True, f'episode {resp.episode_id} started'
        except SequenceAIError as exc:
            resp.accepted, resp.episode_id = False, req.episode_id
            resp.message = f'{_refusal(exc)}: {exc}'
        return resp

    def _end(self, req: EndEpisode.Request, resp: EndEpisode.Response) -> EndEpisode.Response:
        eid = self.runner.request_end('completed', 'ended by ~/end_episode')
        if not eid:
            last = self.runner.last_result
            resp.ok = last is not None
            if last is not None:
                resp.episode_id, resp.reason, resp.message = last.episode_id, last.reason, 'already ended'
            else:
                resp.message = 'no episode has run'
            return resp
        result = self.runner.wait(eid, 10.0)
        resp.episode_id = eid
        if result is None:
            resp.ok, resp.message = False, 'the episode did not end within 10 s'
        else:
            resp.ok, resp.reason, resp.message = True, result.reason, result.message
        return resp

    def _interrupt(self, _req: Trigger.Request, resp: Trigger.Response) -> Trigger.Response:
        eid = self.runner.interrupt()
        resp.success = bool(eid)
        resp.message = f'episode {eid} interrupted; holding' if eid else 'no episode is running'
        return resp

    def _label(self, req: Label.Request, resp: Label.Response) -> Label.Response:
        try:
            eid, stored = self.runner.label(req.success, req.notes, req.episode_id)
            verdict = 'success' if req.success else 'failure'
            resp.ok = stored
            resp.message = f'labelled {eid}: {verdict}'
        except SequenceAIError as exc:
            resp.ok, resp.message = False, str(exc)
        return resp
