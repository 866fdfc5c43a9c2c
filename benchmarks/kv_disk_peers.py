"""A restarted server's first request of an old agent session, radix-mlx's disk tier beside
vllm-mlx's SSD cache, on the same prompts in one run (issue 31).

    python -m benchmarks.kv_disk_peers --preset small

For each server: server 1, on a fresh cache directory, runs the first T-1 turns of
`--sessions` agent sessions (benchmarks.agent_sessions), interleaved. Each turn is sent
as text (vllm-mlx takes no token ids) and answered with one token, which the next turn
carries forward as text, as a text client does. The sessions hold more KV than the
server's memory for it (radix-mlx: `--max-total-tokens`; vllm-mlx: `--cache-memory-mb` of
the same bytes), so the oldest session leaves memory: vllm-mlx's SSD tier holds only what
its memory cache evicts. Server 1 is stopped (SIGTERM). Server 2, on the same directory,
answers a short unrelated warm-up, then the first session's next turn, then a cold prompt
of the same length; each asks for one token, so its latency is its time to first token.

- radix-mlx: `--kv-disk-dir DIR`.
- vllm-mlx (`--ssd-cache-dir DIR`): with a fresh HOME for server 2. vllm-mlx also saves
  its memory cache under ~/.cache/vllm-mlx at exit and loads it at start; a fresh HOME
  leaves its SSD cache alone to carry the session.
- vllm-mlx-with-exit-save: the same with one HOME for both servers, as a user runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.agent_sessions import agent_session_sessions
from benchmarks.peers import PEERS, PeerUnavailable, ensure_installed
from benchmarks.records import Prompt
from benchmarks.serving import ManagedServer
from benchmarks.soak import save_record
from benchmarks.workloads import PromptFactory

RADIX = "radix-mlx"
VLLM, VLLM_EXIT_SAVE = "vllm-mlx", "vllm-mlx-with-exit-save"
SERVERS = (RADIX, VLLM, VLLM_EXIT_SAVE)
# ~8k tokens at the restart (the restart target is on an 8k session): a task, a
# long tool result, then the user's next message after the restart
SESSION = dict(system_len=256, task_len=5632, result_len=2048, message_len=256, output_len=1)


def sessions_prompts(tokenizer, args) -> tuple[list[list[Prompt]], PromptFactory]:
    """Each session's turns without their answers (the server's, added at run time), and
    the factory that makes the cold prompt once the old session's length is known."""
    f = PromptFactory(tokenizer, f"kv-disk-peers:{args.seed}")
    params = dict(SESSION, sessions=args.sessions, turns=3, pool_multiple=1.0)
    sessions = agent_session_sessions(f, **params)
    return [s.turns for s in sessions], f


def first_token(http: httpx.Client, url: str, text: str, model: str) -> dict:
    """A one-token greedy completion of `text`: seconds, answer text, cached tokens (None
    when the server does not report them)."""
    body = {"prompt": text, "max_tokens": 1, "temperature": 0}
    if model:  # vllm-mlx wants it named
        body["model"] = model
    started = time.perf_counter()
    res = http.post(url + "/v1/completions", json=body)
    took = time.perf_counter() - started
    if res.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {res.status_code}: {res.text[:300]}")
    out = res.json()
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    usage = out.get("usage") or {}
    return {"seconds": took, "text": out["choices"][0]["text"],
            "cached": details.get("cached_tokens"),
            "prompt_tokens": usage.get("prompt_tokens")}  # fmt: skip


def memory_flags(server: str, tokens: int, bytes_per_token: int) -> list[str]:
    """The same KV memory for each: tokens in radix-mlx's pool, MiB of vllm-mlx's cache."""
    if server == RADIX:
        return ["--max-total-tokens", str(tokens)]
    return ["--cache-memory-mb", str(math.ceil(tokens * bytes_per_token / 2**20))]


def start(server: str, model: str, args, cache_dir: Path, home: Path | None, n: int):
    """Server `n` (1 or 2) of `server`'s pair, started on `cache_dir`."""
    backend = RADIX if server == RADIX else VLLM
    flags = memory_flags(server, args.memory_tokens, args.bytes_per_token)
    if server == RADIX:
        flags += ["--kv-disk-dir", str(cache_dir), "--kv-disk-block-tokens", str(args.block)]
    logs = Path(args.out) / "logs"
    s = ManagedServer(backend, model, logs, flags if server == RADIX else [])
    s.log_path = logs / f"kv-disk-peers-{server}-{n}.log"
    if server != RADIX:
        s.cmd += ["--ssd-cache-dir", str(cache_dir), *flags]
        if home is not None:
            s.env["HOME"] = str(home)
    print(f"starting {server} ({n}): {' '.join(s.cmd)}", flush=True)
    return s, s.start(timeout=900)


def run_server(server: str, model: str, turns: list[list[Prompt]], f, args) -> dict:
    """Server 1 runs the sessions' first turns, server 2 the first session's next turn and
    a cold prompt of its length: their TTFTs and what the caches gave."""
    work = Path(tempfile.mkdtemp(prefix=f"kv-disk-peers-{server}-"))
    home = work / "home" if server == VLLM_EXIT_SAVE else None
    name = model if server != RADIX else ""
    http = httpx.Client(timeout=3600)
    try:
        s, ep = start(server, model, args, work / "cache", home, 1)
        try:
            history = [t[0].text for t in turns]
            answered = []  # the first session's turns with their answers
            for k in range(1, len(turns[0])):  # round k: every session's k-th turn
                for i, session in enumerate(turns):
                    answer = first_token(http, ep.url, history[i], name)["text"]
                    answered += [(history[i], answer)] if i == 0 else []
                    history[i] += answer + session[k].text
        finally:
            s.stop()
        old = history[0]  # the first session: its history left memory first
        cold = f.prompt(len(f.tokenizer.encode(old))).text
        s, ep = start(server, model, args, work / "cache", home, 2)
        try:
            first_token(http, ep.url, f.piece(16).text, name)  # warm-up: not measured
            restart = first_token(http, ep.url, old, name)
            cold_run = first_token(http, ep.url, cold, name)
        finally:
            s.stop()
        ratio = restart["seconds"] / cold_run["seconds"]
        return {"restart": restart, "cold": cold_run, "ratio": ratio, "log": str(s.log_path),
                "cache_bytes": _du(work / "cache"),
                "answers_kept": answers_kept(f.tokenizer, answered, old)}  # fmt: skip
    finally:
        http.close()
        shutil.rmtree(work, ignore_errors=True)


def answers_kept(tokenizer, answered: list[tuple[str, str]], final: str) -> bool:
    """Whether every turn's prompt tokens followed by its answer's own token come again
    at the start of the last turn's tokens, once the answers are carried as text. A
    cache keyed by prompt + output ids needs it to match the next turn (vllm-mlx's
    entries are keyed so); radix-mlx's blocks lose only the block holding the answer.
    A random-weight model's answer is often a piece that merges with the word before
    it when re-tokenized."""
    ids = tokenizer.encode(final)
    for before, answer in answered:
        expected = tokenizer.encode(before) + tokenizer.encode(answer, add_special_tokens=False)
        if ids[: len(expected)] != expected:
            return False
    return True


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def report(results: dict[str, dict | str]) -> str:
    lines = ["a restarted server's first request of an old ~8k-token agent session, TTFT ÷ a "
             "cold prompt of that length on the same server:"]  # fmt: skip
    for server, r in results.items():
        if isinstance(r, str):
            lines.append(f"  {server}: NOT MEASURED: {r}")
            continue
        rs, cold = r["restart"], r["cold"]
        cached = "not reported" if rs["cached"] is None else f"{rs['cached']} cached"
        lines.append(
            f"  {server}: {rs['seconds']:.3f} s ({rs['prompt_tokens']} prompt tokens, {cached}) "
            f"÷ cold {cold['seconds']:.3f} s = {r['ratio']:.3f}; {r['cache_bytes'] / 2**20:.0f} "
            f"MiB in its cache directory; answers kept as tokens: {r['answers_kept']}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_disk_peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--preset", default="small", help="tiny-model preset (without --model-path)")
    p.add_argument("--model-path", default=None)
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument("--sessions", type=int, default=4, help="sessions run before the restart")
    p.add_argument("--memory-sessions", type=float, default=1.5,
                   help="KV memory of each server, in sessions' last turns")  # fmt: skip
    p.add_argument("--block", type=int, default=256, help="radix-mlx's --kv-disk-block-tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results", help="directory for the JSON record")
    return p.parse_args(argv)


def kv_bytes_per_token(model: str) -> int:
    """Both servers keep KV in the model's dtype: 2 (K, V) x layers x KV heads x head dim."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    size = {"float32": 4}.get(cfg.get("torch_dtype", "float32"), 2)
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * size


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model_path
    if model is None:
        from common.tiny_model import ensure_tiny_model

        model = str(ensure_tiny_model(preset=args.preset))
    from router.serving.model_files import load_tokenizer

    turns, f = sessions_prompts(load_tokenizer(model), args)
    longest = sum(len(f.tokenizer.encode(t.text)) for t in turns[0]) + 2
    args.memory_tokens = int(args.memory_sessions * longest)
    args.bytes_per_token = kv_bytes_per_token(model)
    results: dict[str, dict | str] = {}
    for server in args.servers:
        if server != RADIX:
            try:
                ensure_installed(PEERS[VLLM])
            except PeerUnavailable as exc:
                results[server] = f"vllm-mlx did not install: {exc}"
                continue
        try:
            results[server] = run_server(server, model, turns, f, args)
        except RuntimeError as exc:  # a server that cannot do it: its own words
            results[server] = str(exc)[-2000:]
    text = report(results)
    print(text)
    save_record(args.out, "kv_disk_peers", {"args": vars(args), "report": text, **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
