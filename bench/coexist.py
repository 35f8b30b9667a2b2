"""A patched model beside every other CUDA-graph user in one process: no CUDA error, outputs unchanged.

Per model, in a process of its own: `advisor.optimize(model, inputs)`, the patched model's outputs alone,
then `--calls` calls of the patched model interleaved, round after round, with
- `reduce-overhead`: a `torch.compile(copy, mode="reduce-overhead")` copy (cudagraph trees);
- `static-generate`: HF's static-cache `generate` of a copy (causal LMs; it compiles with CUDA graphs too);
- `user-graph`: a user's own `torch.cuda.graph` capture (a matmul MLP), replayed;
- `second-patched`: a second patched copy of the model;
- `empty-cache`: `torch.cuda.empty_cache()`.
Every patched output must equal (bitwise) its output alone. `--micro` is the mechanism on its own: a graph
with split-K matmuls recorded as our recorder records it (`ours`) or warmed up and captured on one stream
(`one-stream`, the recipe before `graph_pools`), then cuBLAS's workspaces emptied and the cache handed back
(what a reduce-overhead model does), then replayed over fresh allocations.

    python -m bench.coexist --models qwen2,gemma,convnext_tiny --out reports/coexist/coexist   # GPU machine
    python -m bench.coexist --micro ours      # and: --micro one-stream (may crash its process)

Writes OUT.json (merged) and OUT.md.
"""
from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench.common import child_command, child_env, load_results, write_report
from bench.zoo import MODELS as ZOO, _hf, _suite, _vision

def _siglip(device, dtype):
    import torch
    import transformers

    cfg = transformers.SiglipVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                          num_attention_heads=12, image_size=224, patch_size=16)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.SiglipVisionModel(cfg).to(dtype).eval()
    x = torch.randn(64, 3, 224, 224, device=device, dtype=dtype)
    return model, {"pixel_values": x}, "SigLIP-B/16 vision tower, batch 64 x 3 x 224^2"


def _t5_encoder(device, dtype):
    import torch
    import transformers

    cfg = transformers.T5Config(vocab_size=32000, d_model=768, d_ff=3072, num_layers=12, num_heads=12)
    with torch.device(device):
        model = transformers.T5EncoderModel(cfg).to(dtype).eval()
        ids = torch.randint(1, 32000, (32, 512))
    return model, {"input_ids": ids}, "T5 encoder, 12 layers, d 768, batch 32 x 512"


MODELS = {
    "qwen2": ZOO["qwen2"], "gemma": ZOO["gemma"], "mistral": ZOO["mistral"],
    "llama": _suite("hf_llama"),  # the suite's config: hidden 2048 x 8 layers, 4 x 1024 tokens
    "siglip": _siglip,
    "convnext_tiny": _vision("timm", "convnext_tiny", 128, channels_last=True),
    "gpt_neox": _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", 4, 512, 32000, hidden_size=1024, num_hidden_layers=8,
                    num_attention_heads=16, intermediate_size=4096),
    "t5_encoder": _t5_encoder,
    "resnext50": _vision("torchvision", "resnext50_32x4d", 128, channels_last=True),
    # small enough for compute-sanitizer's memcheck and PyTorch's stream sanitizer
    "qwen2_tiny": _hf("Qwen2ForCausalLM", "Qwen2Config", 2, 64, 1024, hidden_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=512),
}
PEERS = ("reduce-overhead", "static-generate", "user-graph", "second-patched", "empty-cache")


def _first_tensor(out):
    import torch

    if isinstance(out, torch.Tensor):
        return out
    vals = out.values() if hasattr(out, "values") else out
    return next(_first_tensor(v) for v in vals if isinstance(v, torch.Tensor) or hasattr(v, "__iter__"))


def _user_graph(device):
    """What a user writes from the CUDA graphs docs: warm up on a side stream, capture, replay."""
    import torch

    w1 = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16) / 64
    w2 = torch.randn(4096, 1024, device=device, dtype=torch.bfloat16) / 64
    x = torch.randn(64, 4096, device=device, dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            torch.relu(x @ w1) @ w2
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = torch.relu(x @ w1) @ w2

    def call():
        g.replay()
        torch.cuda.current_stream().wait_stream(torch.cuda.graph.default_capture_stream)
        return y.clone()
    return call, call()  # its own first replay: a captured matmul may round apart from an eager one


def child(name: str, result: Path, calls: int, peers: list[str], control: bool = False,
          sanitize: str | None = None) -> int:
    import torch

    import advisor

    if sanitize == "memcheck":
        # cudagraph trees' own debug check of its pool ("tensors in the cudagraph pool not tracked as outputs")
        # fails under compute-sanitizer, whose allocations it does not expect: the reduce-overhead copy then
        # failed on its own, before a single round beside it
        import torch._inductor.config as inductor_config
        inductor_config.triton.slow_path_cudagraph_asserts = False

    device, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)
    model, inputs, shape = MODELS[name](device, dtype)
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    pristine = copy.deepcopy(model)
    res = {"model": name, "shape": shape, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
           "peers": {}, "calls": 0, "mismatches": 0, "errors": [], "peer_findings": {}, "sanitize": sanitize,
           "stream_sanitizer": _stream_sanitizer_on()}

    def run(m):
        with torch.no_grad():
            return _first_tensor(m(*args, **kwargs)).clone()

    optimize = (lambda m, i: None) if control else advisor.optimize  # control: the peers beside an unpatched model
    t0 = time.perf_counter()
    report = optimize(model, inputs)
    res["optimize_s"] = round(time.perf_counter() - t0, 1)
    if report is not None:
        doc = json.loads((report.out_dir / "apply.json").read_text())
        res["selection"] = (doc.get("selection") or {}).get("decision")
        res["cuda_graphs_not_used"] = doc.get("cuda_graphs_not_used")
        res["fallbacks"] = doc.get("fallbacks")
    res["control"] = control
    alone = run(model)
    torch.cuda.synchronize()
    steps = {}
    try:
        if "reduce-overhead" in peers:
            compiled = torch.compile(copy.deepcopy(pristine), mode="reduce-overhead")
            steps["reduce-overhead"] = lambda: run(compiled)
        if "static-generate" in peers and hasattr(pristine, "generate") and "input_ids" in kwargs:
            gen = copy.deepcopy(pristine)
            gen.generation_config.cache_implementation = "static"
            prompt = kwargs["input_ids"][:, :64]
            steps["static-generate"] = lambda: gen.generate(prompt, max_new_tokens=8, do_sample=False,
                                                            pad_token_id=0)
        if "user-graph" in peers:
            user_call, user_expect = _user_graph(device)

            def user_step():
                y = user_call()
                if not torch.equal(y, user_expect):  # torch's to answer for, if the control run shows it too
                    res["peer_findings"]["user-graph"] = res["peer_findings"].get("user-graph", 0) + 1
            steps["user-graph"] = user_step
        if "second-patched" in peers:
            second = copy.deepcopy(pristine)
            optimize(second, inputs)
            steps["second-patched"] = lambda: run(second)
        if "empty-cache" in peers:
            steps["empty-cache"] = torch.cuda.empty_cache
        for peer in steps:
            res["peers"][peer] = "ok"
        for i in range(calls):
            if sanitize == "stream-after-capture" and i == 1:
                # Every capture (ours and the peers') was made in round 0: dynamo refuses to trace under the
                # sanitizer's dispatch mode, so it is turned on now, over the replays and their copies
                torch.cuda.synchronize()
                import torch.cuda._sanitizer
                torch.cuda._sanitizer.enable_cuda_sanitizer()
                res["stream_sanitizer"] = _stream_sanitizer_on()
            for peer, step in steps.items():
                try:
                    step()
                except Exception as e:  # a peer's own failure is recorded, the run goes on without it
                    if _is_race(e):
                        res["peer_findings"][f"{peer}: stream sanitizer"] = str(e)[:600]
                        continue
                    if not _is_cuda_error(e):
                        res["peers"][peer] = f"failed on its own: {type(e).__name__}: {str(e)[:200]}"
                        steps = {k: v for k, v in steps.items() if k != peer}
                        break
                    raise
                try:
                    out = run(model)
                except Exception as e:
                    if not _is_race(e):
                        raise
                    res["errors"].append(f"stream sanitizer, patched call after {peer}: {str(e)[:600]}")
                    continue
                res["calls"] += 1
                if not torch.equal(out, alone):
                    res["mismatches"] += 1
                    if len(res["errors"]) < 5:
                        res["errors"].append(f"after {peer} (call {res['calls']}): max |diff| "
                                             f"{(out.float() - alone.float()).abs().max().item():.3g}")
        torch.cuda.synchronize()
    except Exception as e:
        res["errors"].append(f"{type(e).__name__}: {str(e)[:300]}")
        res["traceback"] = traceback.format_exc()[-3000:]
    if report is not None and getattr(report, "handle", None) is not None:
        # what ran instead of the fused path in these calls, per module (a sanitizer's refusal shows here)
        res["fallbacks_after"] = {str(k): v for k, v in report.handle.fallbacks().items()}
    res["ok"] = not res["errors"] and res["mismatches"] == 0 and res["calls"] > 0
    result.write_text(json.dumps(res, indent=1, default=str))
    print(f"{name}: {'ok' if res['ok'] else 'FAILED'}: {res['calls']} patched calls beside {list(steps)}, "
          f"{res['mismatches']} mismatches, errors {res['errors'][:2]}", flush=True)
    return 0 if res["ok"] else 1


def _stream_sanitizer_on() -> bool:
    import torch.cuda._sanitizer  # noqa: F401 (not imported by torch itself unless TORCH_CUDA_SANITIZER is set)

    return bool(getattr(torch.cuda._sanitizer.cuda_sanitizer, "enabled", False))


def _is_race(e: BaseException) -> bool:
    import torch.cuda._sanitizer  # noqa: F401

    return isinstance(e, torch.cuda._sanitizer.CUDASanitizerErrors)


def _is_cuda_error(e: BaseException) -> bool:
    text = str(e)
    return "CUDA error" in text or "illegal memory access" in text or "launch failure" in text


def micro(recipe: str) -> int:
    """Split-K matmuls recorded as `recipe` says, cuBLAS's workspaces emptied and the cache handed back (as
    cudagraph trees do), fresh allocations filled, then replayed: equal to the eager result or not."""
    import torch

    from advisor.patching.graphs import CudaRecorder

    dev = torch.device("cuda")
    torch.manual_seed(0)
    a = torch.randn(64, 16384, device=dev, dtype=torch.bfloat16)  # few rows, long K: cuBLAS splits K
    b = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16)

    def fn(x, y):
        return [(x @ y).float().relu_() @ y[:4096].float()]

    expect = fn(a, b)[0].clone()
    if recipe == "ours":
        replay, outs = CudaRecorder().record(fn, [a, b])
    else:  # warm-up and capture on one stream: its workspace allocated eagerly, outside the graph's pool
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(a, b)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            g.capture_begin(pool=torch.cuda.graph_pool_handle())
            outs = fn(a, b)
            g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        replay = g.replay
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    junk = [torch.full((1 << 26,), float("nan"), device=dev) for _ in range(16)]  # 4 GiB of fresh allocations
    ok = True
    for _ in range(20):
        replay()
        torch.cuda.synchronize()
        ok &= torch.equal(outs[0], expect)
    del junk
    print(f"micro {recipe}: replays {'equal' if ok else 'DIFFER from'} the eager result", flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path("reports/coexist/coexist"))
    p.add_argument("--timeout", type=float, default=420.0)
    p.add_argument("--micro", choices=("ours", "one-stream"))
    p.add_argument("--control", action="store_true", help="the same peers beside the model left unpatched")
    p.add_argument("--sanitize", choices=("memcheck", "stream", "stream-after-capture"),
                   help="memcheck: each model's process under compute-sanitizer's memcheck; stream: under PyTorch's "
                        "stream sanitizer from the start (TORCH_CUDA_SANITIZER=1); stream-after-capture: the sanitizer "
                        "turned on after round 0, every graph captured")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.micro:
        return micro(a.micro)
    peers = [x for x in a.peers.split(",") if x]
    if a.child:
        return child(a.child, a.result, a.calls, peers, a.control, a.sanitize)
    names = [n for n in a.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS] + [x for x in peers if x not in PEERS]
    if unknown:
        print(f"coexist: unknown model(s) or peer(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    doc = load_results(a.out)
    failed = 0
    for name in names:
        result = a.out.parent / f".coexist-{name}.json"
        result.unlink(missing_ok=True)
        t0 = time.perf_counter()
        try:
            cmd = child_command("bench.coexist", "--child", name, "--result", str(result), "--calls", str(a.calls),
                                "--peers", ",".join(peers)) + ["--control"] * a.control + ["--sanitize", a.sanitize] * bool(a.sanitize)
            env = {**child_env(), **({"TORCH_CUDA_SANITIZER": "1"} if a.sanitize == "stream" else {})}
            if a.sanitize == "memcheck":
                cmd = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "97", *cmd]
            proc = subprocess.run(cmd, timeout=a.timeout, capture_output=True, text=True, env=env)
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
        except subprocess.TimeoutExpired:
            proc, tail = None, [f"timed out after {a.timeout:.0f} s"]
        res = json.loads(result.read_text()) if result.exists() else {"model": name, "ok": False,
                                                                     "errors": ["\n".join(tail)]}
        if a.sanitize == "memcheck" and proc is not None:
            summary = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "ERROR SUMMARY" in ln]
            res["memcheck"] = summary[-1].strip("= ").strip() if summary else "no summary (see the log)"
            res["memcheck_exit"] = proc.returncode
            if proc.returncode == 97 or not summary or " 0 errors" not in summary[-1]:
                res["ok"] = False
                res.setdefault("errors", []).append(f"memcheck: {res['memcheck']}")
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        result.unlink(missing_ok=True)
        doc["results"][name] = res
        failed += not res.get("ok")
        print(tail[-1] if tail else name, flush=True)
        write_report(a.out, doc)
    write_report(a.out, doc, markdown(doc))
    return 1 if failed else 0


def markdown(doc: dict) -> str:
    rows = ["| model | patched calls | mismatches | peers | sanitizer | result | the user's own graph |",
            "|---|---|---|---|---|---|---|"]
    for name, r in sorted(doc["results"].items()):
        peers = ", ".join(f"{k}" + ("" if v == "ok" else f" ({v})") for k, v in (r.get("peers") or {}).items())
        verdict = "ok" if r.get("ok") else "FAILED: " + "; ".join(r.get("errors") or [])[:300].replace("\n", " ")
        changed = (r.get("peer_findings") or {}).get("user-graph")
        user = "-" if "user-graph" not in (r.get("peers") or {}) else f"changed in {changed} rounds" if changed else "unchanged"
        sanitizer = r.get("memcheck") or ("stream sanitizer on" if r.get("stream_sanitizer") else r.get("sanitize") or "-")
        found = {k: v for k, v in (r.get("peer_findings") or {}).items() if "sanitizer" in k}
        if found:
            sanitizer += "; peers' own races: " + ", ".join(found)
        rows.append(f"| {name} | {r.get('calls', 0)} | {r.get('mismatches', '-')} | {peers} | {sanitizer} | {verdict} | "
                    f"{user} |")
    return "# Patched models beside other CUDA-graph users (`bench/coexist.py`)\n\n" + "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())
