"""Generation: KV cache == recomputing the prefix, TP/PP == one process, top-k 1 == greedy,
batches of different lengths; the CLI and the HTTP server agree and reject bad requests."""

import dataclasses
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch

from megatron import mpu
from megatron.inference.engine import InferenceModel
from megatron.inference.generation import SamplingParams, generate, generate_greedy
from megatron.inference.streaming import RowsHook
from megatron.model.context import BuildContext
from megatron.models.gpt.model import GPTModel, build_model
from megatron.mpu.parallel_state import destroy_model_parallel, initialize_model_parallel
from tests.helpers.distributed import free_port, run_distributed
from tests.helpers.models import small_gpt
from tests.helpers.paths import ROOT

CFG = small_gpt(num_layers=4, seq_length=32, vocab_size=50, make_vocab_size_divisible_by=16)
ROPE = dataclasses.replace(
    CFG, position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2
)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11]]


def _engine(cfg, state=None, seed=3):
    state = state or mpu.single_process_state()
    chunks = build_model(cfg, BuildContext(state, seed=seed))
    return InferenceModel(chunks, state, cfg.vocab_size, cfg.hidden_size)


def test_greedy_equals_a_manual_argmax_loop_and_never_picks_padding():
    model = GPTModel(CFG, BuildContext(seed=3))
    model.eval()
    got = generate_greedy(model, [1, 2, 3], 8, max_length=CFG.seq_length)
    expected = [1, 2, 3]
    with torch.no_grad():
        for _ in range(8):
            logits = model(torch.tensor([expected]))[0, -1, : CFG.vocab_size]
            expected.append(int(logits.argmax()))
    assert got == expected and all(t < CFG.vocab_size for t in got)


@pytest.mark.slow  # over a second on 2 cores
@pytest.mark.parametrize("cfg", [CFG, ROPE], ids=["gpt2", "rope-gqa"])
def test_kv_cache_equals_recomputing_the_prefix_for_a_ragged_batch(cfg):
    engine = _engine(cfg)
    for params in (
        SamplingParams(10, greedy=True),
        SamplingParams(10, top_k=5, seed=4),
        SamplingParams(10, top_p=0.8, temperature=0.7, seed=5),
    ):
        cached = generate(engine, PROMPTS, params, use_cache=True)
        full = generate(engine, PROMPTS, params, use_cache=False)
        assert cached == full
        assert [c[: len(p)] for c, p in zip(cached, PROMPTS, strict=True)] == PROMPTS
        assert [len(c) - len(p) for c, p in zip(cached, PROMPTS, strict=True)] == [10] * 3
    # A row of a batch equals the same prompt generated alone (no padding leaks in).
    alone = generate(engine, [PROMPTS[1]], SamplingParams(10, greedy=True))[0]
    assert generate(engine, PROMPTS, SamplingParams(10, greedy=True))[1] == alone


@pytest.mark.slow  # over a second on 2 cores
def test_top_k_1_is_greedy_and_eod_stops_a_row():
    engine = _engine(CFG)
    greedy = generate(engine, PROMPTS, SamplingParams(8, greedy=True))
    assert generate(engine, PROMPTS, SamplingParams(8, top_k=1, temperature=0.3)) == greedy
    eod = greedy[0][3]  # the first generated token of row 0
    stopped = generate(engine, PROMPTS, SamplingParams(8, greedy=True), eod=eod)
    assert stopped[0] == PROMPTS[0] + [eod]


_EVAL_BATCH = (torch.arange(24).view(2, 12) % 50, (torch.arange(24).view(2, 12) * 7) % 50)


class _Letters:
    """A tokenizer for the 50 ids of CFG: id i is one letter; 49 ends a document."""

    eod = 49

    def detokenize(self, ids):
        return "".join(chr(48 + i) for i in ids)


def _cancelled_at_step_3(engine, prompts, rank: int = 0):
    """Generation that rank 0 stops at its third step (a streamed request's client hung up);
    the other ranks learn it from rank 0 (streaming.RowsHook)."""
    steps = []

    def cancel() -> bool:
        steps.append(1)
        return engine.flag_from_rank0(rank == 0 and len(steps) >= 3)

    hook = RowsHook(_Letters(), prompts, [], 8, cancel=cancel)
    return generate(engine, prompts, SamplingParams(8, top_k=4, seed=11), step_hook=hook)


def _parallel_worker(rank, world, prompts):
    out = {}
    for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2)):
        state = initialize_model_parallel(tp, pp)
        for label, cfg in (("gpt2", CFG), ("rope", ROPE)):
            engine = _engine(cfg, state)
            out[f"{name}-{label}"] = generate(engine, prompts, SamplingParams(8, top_k=4, seed=11))
            if label == "gpt2":  # every rank leaves the loop after the same step
                out[f"{name}-cancelled"] = _cancelled_at_step_3(engine, prompts, rank)
            losses, argmax = engine.token_losses(*_EVAL_BATCH)  # what evaluation uses
            out[f"{name}-{label}-eval"] = (losses.tolist(), argmax.tolist())
        destroy_model_parallel(state)
    return out


@pytest.mark.slow
def test_tp2_and_pp2_generate_and_evaluate_like_one_process():
    expected = {}
    for label, cfg in (("gpt2", CFG), ("rope", ROPE)):
        engine = _engine(cfg)
        expected[label] = generate(engine, PROMPTS, SamplingParams(8, top_k=4, seed=11))
        if label == "gpt2":
            expected["cancelled"] = _cancelled_at_step_3(engine, PROMPTS)
            assert [len(r) for r in expected["cancelled"]] == [5, 7, 5]  # row 1: its prompt + 1
        losses, argmax = engine.token_losses(*_EVAL_BATCH)
        expected[f"{label}-eval"] = (losses, argmax.tolist())
    for out in run_distributed(_parallel_worker, 2, PROMPTS):
        assert len(out) == 10
        for key, value in out.items():
            label = key.split("-", 1)[1]
            if label.endswith("-eval"):
                torch.testing.assert_close(
                    torch.tensor(value[0]), expected[label][0], rtol=1e-5, atol=1e-6, msg=key
                )
                assert value[1] == expected[label][1], key
            else:
                assert value == expected[label], key


def _put(port, payload: bytes):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/api",
        data=payload,
        method="PUT",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _burst(port, n: int, payload: bytes) -> list:
    """Send n requests at once; each gives its status (503 must carry Retry-After), or the
    exception's name if the connection was reset or refused."""
    out = [None] * n

    def one(i):
        try:
            status, answer = _put(port, payload)
            out[i] = status
        except urllib.error.HTTPError as e:  # a 503 body is JSON too; _put handles HTTPError
            out[i] = e.code
        except OSError as e:
            out[i] = type(e).__name__

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def test_request_fields_are_validated_naming_the_field():
    """Every sampling parameter: finite, in range, right type; 400 text names the field."""
    from megatron.inference.megatron_api import BadRequest, params_of, parse_request

    def reason(**fields):
        body = json.dumps({"prompts": ["x"], **fields}).encode()
        with pytest.raises(BadRequest) as e:
            parse_request(body)
        return str(e.value)

    for value in (float("nan"), float("inf"), 1e-300, -1.0, 1e300, "1", True):
        assert "'temperature'" in reason(temperature=value), value
    for value in (float("nan"), -0.5, 1.5, 1e300, None):
        assert "'top_p'" in reason(top_p=value), value
    for value in (-1, 1.5, float("nan"), True, "3"):
        assert "'top_k'" in reason(top_k=value), value
    for value in (0, -3, 2.0, 10**9, None):
        assert "'tokens_to_generate'" in reason(tokens_to_generate=value), value
    for value in (1.5, "7", -1, 2**80):
        assert "'random_seed'" in reason(random_seed=value), value
    ok = parse_request(json.dumps({"prompts": ["x"], "temperature": 0, "top_k": 5}).encode())
    assert params_of(ok).greedy, "temperature 0 means greedy"
    ok = parse_request(json.dumps({"prompts": ["x"], "temperature": 0.7, "top_p": 0.9}).encode())
    assert not params_of(ok).greedy and params_of(ok).temperature == 0.7


@pytest.mark.slow
def test_server_matches_the_cli_handles_concurrency_and_rejects_bad_requests(checkpoint, tmp_path):
    prompts = ["def main(", "The quick brown fox", "import os"]
    cli = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "generate_text.py"),
            "--load",
            checkpoint,
            *sum((["--prompt", p] for p in prompts), []),
            "--max-new-tokens",
            "12",
            "--top-k",
            "5",
            "--seed",
            "9",
            "--sample-output-file",
            str(tmp_path / "out.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    cli_text = [json.loads(line)["text"] for line in (tmp_path / "out.jsonl").open()]
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tools" / "run_text_generation_server.py"),
            "--load",
            checkpoint,
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        first = server.stdout.readline()
        if "serving checkpoint iteration 7" not in first:
            server.kill()
            raise AssertionError(f"server did not start: {first!r} {server.stderr.read()}")
        body = {"prompts": prompts, "tokens_to_generate": 12, "top_k": 5, "random_seed": 9}
        status, answer = _put(port, json.dumps(body).encode())
        assert status == 200 and answer["text"] == cli_text
        # Concurrent clients each get their own answer.
        alone = {
            p: _put(port, json.dumps({**body, "prompts": [p]}).encode())[1]["text"] for p in prompts
        }
        results = {}
        threads = [
            threading.Thread(
                target=lambda p=p: results.__setitem__(
                    p, _put(port, json.dumps({**body, "prompts": [p]}).encode())[1]["text"]
                )
            )
            for p in prompts * 2
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert results == alone
        for bad, reason in (
            (b"not json", "not JSON"),
            (b'{"prompts": []}', "'prompts'"),
            (b'{"prompts": ["x"], "tokens_to_generate": -1}', "'tokens_to_generate'"),
            (b'{"prompts": ["x"], "top_p": 2}', "'top_p'"),
            (b'{"prompts": ["x"], "bogus": 1}', "unknown fields"),
            (b'{"prompts": ["x"], "temperature": NaN}', "'temperature'"),
            (b'{"prompts": ["x"], "temperature": 1e-300}', "'temperature'"),
            (b'{"prompts": ["x"], "tokens_to_generate": 4096}', "context of 64 positions"),
            (json.dumps({"prompts": ["x " * 300_000]}).encode(), "context of 64 positions"),
        ):
            status, answer = _put(port, bad)
            assert status == 400 and reason in answer["error"], (bad[:80], answer)
        # temperature 0 is greedy: the same as top_k = top_p = 0 at temperature 1
        greedy = {"prompts": prompts, "tokens_to_generate": 5}
        assert _put(port, json.dumps({**greedy, "temperature": 0, "top_k": 7}).encode()) == _put(
            port, json.dumps(greedy).encode()
        )
        statuses = _burst(port, 150, json.dumps({**body, "tokens_to_generate": 2}).encode())
        assert set(statuses) <= {200, 503} and 200 in statuses, statuses
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow
def test_tp2_server_survives_a_bad_request_and_a_failing_one(checkpoint, tmp_path):
    """A TP = 2 server: requests that crashed rank 1 (and with it the server) get a 400, and
    the next good request still gets a 200 from both ranks together."""
    tp2 = tmp_path / "tp2"
    conv = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "convert_checkpoint.py"),
            "--load",
            checkpoint,
            "--save",
            str(tp2),
            "--target-tensor-model-parallel-size",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert conv.returncode == 0, conv.stderr
    port, master = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master))
    servers = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tools" / "run_text_generation_server.py"),
                "--load",
                str(tp2),
                "--port",
                str(port),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(2)
    ]
    try:
        first = servers[0].stdout.readline()
        assert "serving checkpoint iteration 7" in first, servers[0].stderr.read()
        for bad in (
            b'{"prompts": ["x"], "temperature": NaN}',
            b'{"prompts": ["x"], "temperature": 1e-300}',
            b'{"prompts": ["x"], "tokens_to_generate": 4096}',
        ):
            status, answer = _put(port, bad)
            assert status == 400, answer
        good = {"prompts": ["def main("], "tokens_to_generate": 4, "top_k": 3, "random_seed": 2}
        status, answer = _put(port, json.dumps(good).encode())
        assert status == 200 and len(answer["tokens"][0]) >= 1, answer
        assert all(s.poll() is None for s in servers), "a rank exited"
    finally:
        for s in servers:
            s.terminate()
        for s in servers:
            try:
                s.wait(timeout=30)
            except subprocess.TimeoutExpired:
                s.kill()
                s.wait()
