"""A test sandbox server: speaks Sandbox gRPC, runs model-only episodes through the router.

Each episode makes `--turns` Router.Generate calls with the sample id as session key, each
prompt extending the previous prompt and output (token-in, token-out), and returns the
trajectory with the engine's log-probs and per-token weight versions and a random 0/1 reward,
or, with `--reward-token T`, a reward of `--reward-scale` when the first generated token is T
and 0 otherwise (a task whose reward depends on one token; `--prompt` fixes the prompt text).
No sandboxes, no commands: for testing the rollout service without the sandbox service.

    python -m services.testing.episode_server --port P --router HOST:PORT --tasks a,b
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import time

import grpc

from services._proto.riptide.v1 import (
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    sandbox_pb2,
    sandbox_pb2_grpc,
)
from services.common.grpc_client import aio_channel


def prompt_ids(text: str) -> list[int]:
    """The episode's prompt ids for `text` (byte-like ids inside the tiny model's vocabulary)."""
    return [ord(c) % 200 + 3 for c in text]


class EpisodeServicer(sandbox_pb2_grpc.SandboxServicer):
    """Model-only episodes against the router."""

    def __init__(self, router: router_pb2_grpc.RouterStub, task_ids: list[str], turns: int,
                 observation_tokens: int, prompt: str | None = None,
                 reward_token: int | None = None, reward_scale: float = 1.0) -> None:
        self.router, self.task_ids, self.turns = router, task_ids, turns
        self.observation_tokens = observation_tokens
        self.prompt, self.reward_token, self.reward_scale = prompt, reward_token, reward_scale
        self.rng = random.Random(0)

    async def ListTasks(self, request: sandbox_pb2.ListTasksRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> sandbox_pb2.ListTasksResponse:
        return sandbox_pb2.ListTasksResponse(task_ids=self.task_ids)

    async def RunEpisode(self, request: sandbox_pb2.RunEpisodeRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        start = time.monotonic()
        text = self.prompt or f"{request.task_id}:{request.sample_index}"
        prompt = prompt_ids(text)
        traj = common_pb2.Trajectory(prompt_ids=prompt)
        history = list(prompt)
        for turn in range(self.turns):
            reply = await self.router.Generate(router_pb2.GenerateRequest(
                session_key=request.sample_id, input_ids=history,
                sampling_params=request.sampling_params, return_logprob=True,
                request_id=f"{request.sample_id}-t{turn}"))
            n = len(reply.output_ids)
            traj.response_ids.extend(reply.output_ids)
            traj.loss_mask.extend([1] * n)
            traj.rollout_logprobs.extend(list(reply.output_logprobs) or [0.0] * n)
            traj.weight_versions.extend([reply.weight_version] * n)
            observation = [5 + (turn + i) % 50 for i in range(self.observation_tokens)]
            traj.response_ids.extend(observation)
            traj.loss_mask.extend([0] * len(observation))
            traj.rollout_logprobs.extend([0.0] * len(observation))
            traj.weight_versions.extend([-1] * len(observation))
            history += list(reply.output_ids) + observation
            yield sandbox_pb2.EpisodeEvent(progress=sandbox_pb2.EpisodeProgress(
                kind="turn", turn=turn + 1, elapsed_s=time.monotonic() - start))
        if self.reward_token is None:
            traj.reward = float(self.rng.random() < 0.5)
        else:
            hit = len(traj.response_ids) > 0 and traj.response_ids[0] == self.reward_token
            traj.reward = self.reward_scale if hit else 0.0
        traj.status = common_pb2.VERDICT_STATUS_SCORED
        traj.num_turns = self.turns
        traj.finish_reason = "max_turns"
        traj.timings.total_s = time.monotonic() - start
        yield sandbox_pb2.EpisodeEvent(trajectory=traj)


async def _main(args: argparse.Namespace) -> None:
    # The router's gRPC token, if the stack has one, from the environment (never argv).
    channel = aio_channel(args.router, os.environ.get("RIPTIDE_GRPC_TOKEN"))
    server = grpc.aio.server()
    sandbox_pb2_grpc.add_SandboxServicer_to_server(EpisodeServicer(
        router_pb2_grpc.RouterStub(channel), args.tasks.split(","), args.turns,
        args.observation_tokens, args.prompt, args.reward_token, args.reward_scale), server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(2.0)
    await channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--router", required=True, help="host:port of Router gRPC")
    parser.add_argument("--tasks", default="task-a,task-b,task-c", help="comma-separated ids")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--observation-tokens", type=int, default=4)
    parser.add_argument("--prompt", default=None, help="one prompt text for every episode")
    parser.add_argument("--reward-token", type=int, default=None,
                        help="reward depends on whether the first generated token is this id")
    parser.add_argument("--reward-scale", type=float, default=1.0,
                        help="reward of a first token equal to --reward-token (negative flips "
                             "the advantage's sign)")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
