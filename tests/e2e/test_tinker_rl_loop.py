"""End to end: the demo job's services (real vLLM rollout, weight sync) and the Tinker front over them; the
cookbook-style loop in examples/tinker/rl_loop.py, on the official `tinker` client only, learns the demo task;
the same front samples with prompt logprobs (compute_logprobs) that agree with the trainer's, and with the top
alternatives of each prompt and sampled token; two users on its one engine, one at the SDK's default rank, cannot
change what the other samples; on-policy distillation the Tinker way, a teacher sampling client scoring the
student's samples on the same engine, and a saved sampler path restored after the rollout let it go; two tenants
that cannot see or touch each other's sessions, models, samplers, paths, runs or futures on any route, and the
limits of one (models, adapter slots, requests in flight); then tinker-cookbook's own RL and distillation loops,
unpatched, learn through the same front."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ["loop.mode=sync", "output.tensorboard=false", "output.progress=false"]


def test_the_cookbook_style_loop_learns_through_the_tinker_front(tmp_path: Path) -> None:
    import tinker
    from tinker import types

    from lorarl.client.launch.tinker import local_front
    from lorarl.tinker.tenants import FrontTenant, TenantLimits

    team_b = FrontTenant("team-b", (f"tml-{secrets.token_urlsafe(16)}",), TenantLimits(
        max_models=2, max_sampling_models=1, max_in_flight=1, max_waiting=1))
    with local_front(ROOT / "examples/demo.yaml", [*SETTINGS, f"output.dir={tmp_path}"],
                     other_tenants=[team_b]) as front:
        env = {**os.environ, "TINKER_BASE_URL": front.base_url, "TINKER_API_KEY": front.api_key,
               "TINKER_TELEMETRY": "0", "EVAL_PROBLEMS": "100", "TINKER_BASE_MODEL": front.base_model}
        done = subprocess.run([sys.executable, "examples/tinker/rl_loop.py", "16"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=800)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        before = float(re.search(r"accuracy before: ([\d.]+)", done.stdout).group(1))
        after = float(re.search(r"accuracy after:\s+([\d.]+)", done.stdout).group(1))
        print(done.stdout[-1500:])
        # within ~10 points of healthy runs (issue "the first hour"): +41.0 (b6a6082, 2026-12-04) and +37.0
        # (90ce2ec with stop 52's changes, 2026-12-07), 16 steps on this 2-core machine
        assert after - before >= 0.28, done.stdout

        service = tinker.ServiceClient(base_url=front.base_url, api_key=front.api_key)
        training = service.create_lora_training_client(base_model=front.base_model, rank=4).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        tokens = training.get_tokenizer().encode("12+34=56")
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        assert scored[0] is None and len(scored) == len(tokens)
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64")})
        trained = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        assert all(abs(a - b) < 1e-3 for a, b in zip(scored[1:], trained, strict=True)), (scored, trained)
        greedy = types.SamplingParams(max_tokens=3, temperature=0.0)
        reply = sampler.sample(types.ModelInput.from_ints(tokens), 1, greedy, include_prompt_logprobs=True,
                               topk_prompt_logprobs=2, topk_sample_logprobs=3).result()
        tops = reply.topk_prompt_logprobs
        assert tops[0] is None and len(tops) == len(tokens)
        for own, top in zip(reply.prompt_logprobs[1:], tops[1:], strict=True):
            assert len(top) == 2 and top[0][1] >= top[1][1] and top[0][1] >= own - 1e-5
        (sequence,) = reply.sequences
        assert [top[0][0] for top in sequence.topk_logprobs] == sequence.tokens  # greedy: the top token each time
        assert all(len(top) == 3 for top in sequence.topk_logprobs)
        service.close("success")
        users_on_one_engine_cannot_change_what_the_other_samples(front)
        tenants_cannot_reach_each_other_on_any_route(front, team_b.keys[0])
        a_teacher_on_the_same_engine_distils_a_student(front)
        the_cookbooks_own_loops_learn_unchanged(env)


def the_cookbooks_own_loops_learn_unchanged(env: dict[str, str]) -> None:
    """Tenants issue: Thinking Machines' tinker-cookbook (0.6.1, unpatched) drives the front with its own RL loop
    (`tinker_cookbook.rl.train`) and its own on-policy distillation (`distillation.train_on_policy`, the teacher
    an adapter on the same base, taught through the front first), one after the other on this front after the
    runs above (no slot left held). Healthy runs (this 2-core CPU, 2026-12-07, 08b063a + the examples): RL
    0.360 -> 0.810, 0.780, 0.870 in 24 steps; distillation 0.360 -> 0.700, 0.710, 0.710 in 10 steps (teacher
    0.710); the floors sit ~10-12 points below the worst of each."""
    for script, args, floor in (("examples/tinker/cookbook_rl.py", "24", 0.33),
                                ("examples/tinker/cookbook_distill.py", "10", 0.22)):
        done = subprocess.run([sys.executable, script, args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        before = float(re.search(r"accuracy before: ([\d.]+)", done.stdout).group(1))
        after = float(re.search(r"accuracy after:\s+([\d.]+)", done.stdout).group(1))
        print(script, done.stdout[-600:])
        assert after - before >= floor, done.stdout


def users_on_one_engine_cannot_change_what_the_other_samples(front) -> None:
    """Tenants issue: user A trains a rank-8 adapter and samples; user B, another session, takes the SDK's default
    rank (32), trains and saves. B's adapter is served as an adapter (`lorarl tinker` sizes its shared rollout for
    the SDK's default), A's sampler answers with the same logprobs after B's save, and a rank the rollout cannot
    serve as an adapter is refused at creation naming the limit and the setting, never merged over the base."""
    import tinker
    from tinker import types

    def datum(tokens: list[int]) -> types.Datum:
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64")})

    def trained_sampler(client, tokens: list[int]):
        client.forward_backward([datum(tokens)], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-1)).result()
        return client.save_weights_and_get_sampling_client().result()

    user_a = tinker.ServiceClient(base_url=front.base_url, api_key=front.api_key)
    user_b = tinker.ServiceClient(base_url=front.base_url, api_key=front.api_key)
    try:
        a = user_a.create_lora_training_client(base_model=front.base_model, rank=8).result()
        tokens = a.get_tokenizer().encode("12+34=46")
        sampler_a = trained_sampler(a, tokens)
        prompt = types.ModelInput.from_ints(tokens)
        before = sampler_a.compute_logprobs(prompt).result()
        b = user_b.create_lora_training_client(base_model=front.base_model).result()  # the SDK's default rank
        assert b.get_info().lora_rank == 32
        sampler_b = trained_sampler(b, tokens[::-1])
        theirs = sampler_b.compute_logprobs(prompt).result()
        after = sampler_a.compute_logprobs(prompt).result()
        assert after[1:] == pytest.approx(before[1:], abs=1e-5), (before, after)  # B changed nothing of A's
        assert theirs[1:] != pytest.approx(before[1:], abs=1e-3)  # B samples its own adapter
        refusal = (r"LoRA rank 64 is above the rank this shared rollout serves \(rollout\.max_lora_rank=32\).*"
                   r"rollout\.max_lora_rank=64")
        with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError), match=refusal):
            user_b.create_lora_training_client(base_model=front.base_model, rank=64).result()
        assert sampler_a.compute_logprobs(prompt).result()[1:] == pytest.approx(before[1:], abs=1e-5)
        listed = user_a.create_rest_client().list_checkpoints(a.model_id).result().checkpoints  # the REST view
        assert [c.checkpoint_type for c in listed] == ["sampler"] and listed[0].tinker_path.startswith(
            f"tinker://{a.model_id}/sampler_weights/")
    finally:
        user_a.close("success")
        user_b.close("success")


def tenants_cannot_reach_each_other_on_any_route(front, key_b: str) -> None:
    """Tenants issue, item 2: tenant A (the front's default key) trains, saves a state and sampler weights and
    samples; tenant B (its own key) then calls every route that names a resource with A's ids and paths: each is
    answered as if A's did not exist (400/404/410, or a future that fails "unknown"), A's session, model, paths
    and sampler keep working as before, and B's view of runs and checkpoints holds none of A's. Then B's own
    limits: its third model, its second model loaded for sampling, and a third request while two wait (sent
    ahead of their model's turn) are refused by name — the last as HTTP 429 with Retry-After — while A's request
    beside them is taken; when B's session ends its waiting requests fail by name and its queue is free again."""
    import asyncio

    import httpx
    import tinker
    from tinker import types
    from tinker.proto import tinker_public_pb2 as pb

    from lorarl.tinker.app import UNOWNED_ROUTES, create_app
    from lorarl.tinker.service import TinkerService
    from lorarl.tinker.tenants import FrontTenants

    def datum(tokens: list[int]) -> types.Datum:
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64")})

    api = f"{front.base_url}/api/v1"
    user_a = tinker.ServiceClient(base_url=front.base_url, api_key=front.api_key)
    user_b = tinker.ServiceClient(base_url=front.base_url, api_key=key_b)
    b = httpx.Client(headers={"X-API-Key": key_b}, timeout=60)
    a_raw = httpx.Client(headers={"X-API-Key": front.api_key}, timeout=60)
    try:
        a = user_a.create_lora_training_client(base_model=front.base_model, rank=8).result()
        tokens = a.get_tokenizer().encode("12+34=46")
        a.forward_backward([datum(tokens)], "cross_entropy").result()
        a.optim_step(types.AdamParams(learning_rate=1e-1)).result()
        state_path = a.save_state("a-state").result().path
        sampler_a = a.save_weights_and_get_sampling_client().result()
        sampler_path = next(c.tinker_path for c in user_a.create_rest_client().list_checkpoints(a.model_id)
                            .result().checkpoints if c.checkpoint_type == "sampler")
        prompt = types.ModelInput.from_ints(tokens)
        before = sampler_a.compute_logprobs(prompt).result()
        a_session, a_model, a_sampler = user_a.holder.get_session_id(), a.model_id, sampler_a._sampling_session_id
        b_session = user_b.holder.get_session_id()
        sample_body = {"prompt": prompt.model_dump(mode="json"), "num_samples": 1,
                       "sampling_params": {"max_tokens": 4, "temperature": 1.0}}
        a_request = a_raw.post(f"{api}/asample", json={**sample_body, "sampling_session_id": a_sampler}).json()
        a_raw.post(f"{api}/retrieve_future", json={"request_id": a_request["request_id"]})

        def failed_future(response: httpx.Response, message: str) -> None:
            assert response.status_code == 200, response.text
            outcome = b.post(f"{api}/retrieve_future", json={"request_id": response.json()["request_id"]}).json()
            assert message in outcome.get("error", ""), outcome

        fwd = pb.ForwardBackwardRequest(model_id=a_model, seq_id=1000)
        tried = {
            "POST /api/v1/session_heartbeat": (b.post(f"{api}/session_heartbeat", json={"session_id": a_session}),
                                               410, "unknown session"),
            "POST /api/v1/sessions/{session_id}/finish": (b.post(f"{api}/sessions/{a_session}/finish"), 200, ""),
            "POST /api/v1/get_info": (b.post(f"{api}/get_info", json={"model_id": a_model}), 400, "unknown model_id"),
            "POST /api/v1/forward_backward": (b.post(f"{api}/forward_backward", content=fwd.SerializeToString(),
                                                     headers={"content-type": "application/x-protobuf"}),
                                              400, "unknown model_id"),
            "POST /api/v1/optim_step": (b.post(f"{api}/optim_step", json={
                "model_id": a_model, "seq_id": 1000, "optim_params": {"learning_rate": 0.1}}), 400, "unknown model_id"),
            "POST /api/v1/save_weights_for_sampler": (b.post(f"{api}/save_weights_for_sampler", json={
                "model_id": a_model, "seq_id": 1000}), 400, "unknown model_id"),
            "POST /api/v1/save_weights": (b.post(f"{api}/save_weights", json={
                "model_id": a_model, "seq_id": 1000, "path": "taken"}), 400, "unknown model_id"),
            "POST /api/v1/create_sampling_session": (b.post(f"{api}/create_sampling_session", json={
                "session_id": b_session, "sampling_session_seq_id": 7, "model_path": sampler_path}),
                400, "no sampler weights"),
            "GET /api/v1/samplers/{sampler_id}": (b.get(f"{api}/samplers/{a_sampler}"), 400, "unknown sampler"),
            "POST /api/v1/asample": (b.post(f"{api}/asample", json={**sample_body, "sampling_session_id": a_sampler}),
                                     400, "unknown sampling_session_id"),
            "GET /api/v1/training_runs/{run_id}": (b.get(f"{api}/training_runs/{a_model}"), 404, "no training run"),
            "GET /api/v1/training_runs/{run_id}/checkpoints": (b.get(f"{api}/training_runs/{a_model}/checkpoints"),
                                                               404, "no training run"),
            "DELETE /api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}": (
                b.delete(f"{api}/training_runs/{a_model}/checkpoints/weights/a-state"), 404, "no training run"),
            "POST /api/v1/weights_info": (b.post(f"{api}/weights_info", json={"tinker_path": state_path}),
                                          404, "no training run"),
            "PUT /api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl": (
                b.put(f"{api}/training_runs/{a_model}/checkpoints/weights/a-state/ttl", json={"ttl_seconds": 3600}),
                404, "no training run"),
            "POST /api/v1/retrieve_future": (b.post(f"{api}/retrieve_future", json={
                "request_id": a_request["request_id"]}), 404, "unknown request_id"),
        }
        for route, (response, status, message) in tried.items():
            assert response.status_code == status and message in response.text, (route, response.text)
        listed = b.get(f"{api}/training_runs").json()["training_runs"]
        assert a_model not in {r["training_run_id"] for r in listed}, listed
        assert not {c["tinker_path"] for c in b.get(f"{api}/checkpoints").json()["checkpoints"]} & {
            state_path, sampler_path}
        tried["GET /api/v1/training_runs"] = tried["GET /api/v1/checkpoints"] = (None, 200, "")
        failed_future(b.post(f"{api}/create_model", json={"session_id": a_session, "model_seq_id": 99,
                                                           "base_model": front.base_model}), "unknown session_id")
        response = b.post(f"{api}/load_weights", json={"model_id": a_model, "seq_id": 1000, "path": state_path,
                                                        "optimizer": True})
        assert response.status_code == 400 and "unknown model_id" in response.text, response.text
        failed_future(b.post(f"{api}/load_weights", json={"session_id": b_session, "model_seq_id": 50,
                                                           "path": state_path, "optimizer": False}),
                      "no checkpoint at")
        tried["POST /api/v1/create_model"] = tried["POST /api/v1/load_weights"] = (None, 200, "")
        # every route of the app is either tried above or names nothing of a tenant's (UNOWNED_ROUTES)
        async def app_routes() -> set[str]:  # the service's gRPC channels are made in a running loop
            app = create_app(TinkerService({}, "127.0.0.1:1", tenants=FrontTenants.single(["tml-x"])))
            return {f"{m} {r.path}" for r in app.routes for m in getattr(r, "methods", ()) if m != "HEAD"}

        routes = asyncio.run(app_routes())
        routes = {r for r in routes if "/docs" not in r and "openapi" not in r and "redoc" not in r}
        assert routes == set(tried) | UNOWNED_ROUTES, routes ^ (set(tried) | UNOWNED_ROUTES)
        # A's things are untouched: its session lives, its paths load and list, its sampler answers as before
        assert a_raw.post(f"{api}/session_heartbeat", json={"session_id": a_session}).status_code == 200
        assert sampler_a.compute_logprobs(prompt).result()[1:] == pytest.approx(before[1:], abs=1e-5)
        assert {c.tinker_path for c in user_a.create_rest_client().list_checkpoints(a_model).result().checkpoints} \
            == {state_path, sampler_path}
        user_a.create_training_client_from_state(state_path).result()

        # B's limits: 2 models, 1 of them loaded for sampling, 1 request running and 1 waiting
        b1 = user_b.create_lora_training_client(base_model=front.base_model, rank=8).result()
        b2 = user_b.create_lora_training_client(base_model=front.base_model, rank=8).result()
        with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError),
                           match=r"tenant 'team-b' has 2 training models.*max_models 2"):
            user_b.create_lora_training_client(base_model=front.base_model, rank=8).result()
        for client in (b1, b2):
            client.forward_backward([datum(tokens)], "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=1e-1)).result()
        sampler_b = b1.save_weights_and_get_sampling_client().result()
        with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError),
                           match=r"tenant 'team-b' has 1 models loaded on the rollout.*max_sampling_models 1"):
            b2.save_weights_and_get_sampling_client().result()
        # B's queue (1 running + 1 waiting) filled deterministically: two of b2's requests sent ahead of their
        # turn (seq_ids it has not reached) are accepted and wait; a sample would take a place, and is refused
        ahead = [b.post(f"{api}/optim_step", json={"model_id": b2.model_id, "seq_id": 10_000 + i,
                                                   "optim_params": {"learning_rate": 0.1}}) for i in range(2)]
        assert [r.status_code for r in ahead] == [200, 200], [r.text for r in ahead]
        refused = b.post(f"{api}/asample", json={**sample_body, "sampling_session_id": sampler_b._sampling_session_id})
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "2" and "max_in_flight" in refused.text, refused.text
        beside = a_raw.post(f"{api}/asample", json={**sample_body, "sampling_session_id": a_sampler})
        assert beside.status_code == 200, beside.text  # A's request is taken beside B's full queue
        # B's session ends: the requests that waited for their turn fail by name and leave B's queue
        assert b.post(f"{api}/sessions/{b_session}/finish").status_code == 200
        for r in ahead:
            outcome = b.post(f"{api}/retrieve_future", json={"request_id": r.json()["request_id"]}).json()
            assert "ended (its session finished)" in outcome.get("error", ""), outcome
        again = tinker.ServiceClient(base_url=front.base_url, api_key=key_b)
        try:  # room again: a new session's model is accepted and made (its models and queue were freed)
            again.create_lora_training_client(base_model=front.base_model, rank=8).result()
        finally:
            again.close("success")
    finally:
        b.close()
        a_raw.close()
        user_a.close("success")
        user_b.close("success")


def a_teacher_on_the_same_engine_distils_a_student(front) -> None:
    """Teachers are adapters (#47), the Tinker cookbook's way: a teacher training client (taught the task's answers
    by cross-entropy) saves a sampling client; a fresh student samples, the teacher's sampling client scores the
    student's tokens with compute_logprobs (the front's one rollout engine, where the student's adapter is served
    too: no second base), and the student trains with importance_sampling on advantages -(log student - log
    teacher) and the SDK's own Adam parameters (only the learning rate given). The reverse KL to the teacher on
    fresh samples falls, and the teacher's scores are its training client's own logprobs."""
    import tinker
    from tinker import types

    from lorarl.assets.tasks import load_split

    service = tinker.ServiceClient(base_url=front.base_url, api_key=front.api_key)
    try:
        teacher = service.create_lora_training_client(base_model=front.base_model, rank=8).result()
        tokenizer = teacher.get_tokenizer()

        def prompt(text: str) -> list[int]:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

        def datum(tokens: list[int], completion: list[int], **inputs: list[float]) -> types.Datum:
            """prompt + completion, each position predicting the next; ``inputs`` per completion token (0 before)."""
            full, pad = tokens + completion, [0.0] * (len(tokens) - 1)
            return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                "target_tokens": types.TensorData(data=full[1:], dtype="int64"),
                **{k: types.TensorData(data=pad + v, dtype="float32") for k, v in inputs.items()}})

        problems = load_split("train")[:96]
        eos = tokenizer.eos_token_id
        for step in range(6):  # the teacher: the answers, by cross-entropy
            batch = []
            for p in problems[16 * step: 16 * step + 16]:
                answer = [*tokenizer.encode(p.answer, add_special_tokens=False), eos]
                batch.append(datum(prompt(p.prompt), answer, weights=[1.0] * len(answer)))
            teacher.forward_backward(batch, "cross_entropy").result()
            teacher.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        teacher_sampler = teacher.save_weights_and_get_sampling_client().result()
        student = service.create_lora_training_client(base_model=front.base_model, rank=8).result()
        held = [prompt(p.prompt) for p in load_split("test")[:16]]
        kls, checked = [], False
        for step in range(5):
            if step == 1:  # the first trained weights, saved by name: sampled again at the end
                first_path = student.save_weights_for_sampler(name="first").result().path
                sampler = service.create_sampling_client(model_path=first_path)
                probe = types.ModelInput.from_ints(held[0] + held[1])
                first_scores = sampler.compute_logprobs(probe).result()
            else:
                sampler = student.save_weights_and_get_sampling_client().result()
            # one seed per prompt, the same every step: the steps' KL estimates share their sampling noise, so
            # the fall is the student's (without seeds one run read 0.249 -> 0.155, another 0.364 -> 0.158)
            samples = [(t, sampler.sample(types.ModelInput.from_ints(t), 4,
                                          types.SamplingParams(max_tokens=8, temperature=1.0, seed=i)))
                       for i, t in enumerate(held)]
            rows = [(t, list(s.tokens), list(s.logprobs)) for t, f in samples for s in f.result().sequences if s.tokens]
            scores = [teacher_sampler.compute_logprobs(types.ModelInput.from_ints(t + c)) for t, c, _ in rows]
            batch, terms = [], []
            for (tokens, completion, own), future in zip(rows, scores, strict=True):
                theirs = future.result()[len(tokens):]
                reverse_kl = [a - b for a, b in zip(own, theirs, strict=True)]
                terms += reverse_kl
                batch.append(datum(tokens, completion, logprobs=own, advantages=[-k for k in reverse_kl]))
                if not checked:  # the teacher's scores are its own training client's logprobs of those tokens
                    own_view = teacher.forward([datum(tokens, completion, weights=[1.0] * len(completion))],
                                               "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
                    assert own_view[len(tokens) - 1:] == pytest.approx(theirs, abs=1e-3)
                    checked = True
            kls.append(sum(terms) / len(terms))
            student.forward_backward(batch, "importance_sampling").result()
            student.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        print(f"reverse KL to the teacher per step: {[round(k, 4) for k in kls]}")
        # seeded, at lr 5e-3 (2026-12-07, this 2-core CPU, twice alike): 0.341 -> 0.310, 0.216, 0.172, 0.161; at 2e-3
        # the same seeds fell only to 0.223 (0.65x)
        assert kls[-1] < 0.6 * kls[0], kls
        for _ in range(2):  # the student moves on: "first" is 6 versions old, past the rollout's window
            student.forward_backward(batch, "importance_sampling").result()
            student.optim_step(types.AdamParams(learning_rate=5e-3)).result()
            student.save_weights_and_get_sampling_client().result()
        # saved sampler paths stay servable (tenants issue): restored from the adapter exported when saved, they
        # score as they did then, while the session lasts and after it ended (its job and adapters freed)
        again = service.create_sampling_client(model_path=first_path).compute_logprobs(probe).result()
        assert again[1:] == pytest.approx(first_scores[1:], abs=1e-4)
        assert again[1:] != pytest.approx(student.save_weights_and_get_sampling_client().result().compute_logprobs(
            probe).result()[1:], abs=1e-3)  # not the student's current weights
    finally:
        service.close("success")
    later = tinker.ServiceClient(base_url=front.base_url, api_key=front.api_key)
    try:
        after_end = later.create_sampling_client(model_path=first_path).compute_logprobs(probe).result()
        assert after_end[1:] == pytest.approx(first_scores[1:], abs=1e-4)
    finally:
        later.close("success")

