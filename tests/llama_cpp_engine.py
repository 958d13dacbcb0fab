"""llama.cpp itself, for the serving test: a prebuilt CPU build of llama.cpp from PyPI, greedy decoding.

`llama-cpp-python` ships only a source distribution (building llama.cpp took more than 45 minutes on this
2-core machine); `llama-cpp-cffi` ships llama.cpp prebuilt in its wheel. Its 0.4.17 wheel is the newest built
for manylinux_2_28 (later ones need GCC 14's libstdc++, which Debian 12 lacks), and its pinned dependencies
(attrs < 25, huggingface-hub < 0.27, protobuf < 6, ...) conflict with the lab's, so it is not a dependency:
`install()` puts the wheel alone (``--no-deps``) in a cache directory, and the engine runs in a child process
with that directory on its path, loading only its compiled cffi bindings of llama.cpp's C API (CPU build).

    PYTHONPATH=$(python -c "from tests.llama_cpp_engine import install; print(install())") \
        python tests/llama_cpp_engine.py MODEL.gguf 1,2,3 16   # the 16 greedy tokens after ids 1,2,3 (JSON)
    echo '["text", ...]' | PYTHONPATH=... python tests/llama_cpp_engine.py --tokenize MODEL.gguf  # ids per text
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = "llama-cpp-cffi==0.4.17"


def install(cache: Path | None = None) -> Path:
    """The directory holding the engine's wheel, installed there on first use (about 320 MB)."""
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moe-lab" / "engines"
    target = cache / PACKAGE.replace("==", "-")
    if not (target / "llama" / "llama_cpp.py").is_file():
        tmp = target.with_name(target.name + ".partial")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:"]
            + ["--target", str(tmp), "--upgrade", PACKAGE],
            check=True,
            timeout=900,
        )
        tmp.rename(target)  # whole or not at all: a half-installed directory is never used
    return target


def greedy(gguf_file: Path, prompt_ids: list[int], new_tokens: int, site: Path) -> dict:
    """Run llama.cpp on ``gguf_file`` in a child process: the greedy continuation of ``prompt_ids`` and the
    logits after the prompt."""
    return _child([str(gguf_file), ",".join(map(str, prompt_ids)), str(new_tokens)], site, "run")


def tokenize(gguf_file: Path, texts: list[str], site: Path) -> list[list[int]]:
    """llama.cpp's tokenization of each text with the file's vocabulary (its pre-tokenizer included), in a child
    process: no BOS/EOS added, special-token text not parsed (as ``tokenizer(text, add_special_tokens=False)``)."""
    return _child(["--tokenize", str(gguf_file)], site, "tokenize", stdin=json.dumps(texts))


def _child(args: list[str], site: Path, what: str, stdin: str | None = None):
    """This file run as a script with ``args`` beside the engine's ``site``; the JSON of its last output line."""
    out = subprocess.run(
        [sys.executable, __file__, *args],
        input=stdin,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        raise RuntimeError(f"llama.cpp {what} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _bindings():
    # llama-cpp-cffi's compiled bindings of llama.h, loaded alone: its package __init__ imports a chat
    # formatter stack (transformers, jinja2, ...) that this check does not need
    (so,) = Path(os.environ["PYTHONPATH"], "llama").glob("_llama_cpp_cpu.*.so")
    spec = importlib.util.spec_from_file_location("_llama_cpp_cpu", so)
    bindings = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bindings)
    return bindings.ffi, bindings.lib


def _tokenize(gguf_file: str) -> None:
    ffi, lib = _bindings()
    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.vocab_only = True  # the vocabulary and pre-tokenizer only, no weights
    model = lib.llama_model_load_from_file(gguf_file.encode(), params)
    if model == ffi.NULL:
        raise SystemExit(f"llama.cpp could not load {gguf_file}")
    vocab = lib.llama_model_get_vocab(model)
    result = []
    for text in json.loads(sys.stdin.read()):
        data = text.encode()
        ids = ffi.new("llama_token[]", 4 * len(data) + 8)
        n = lib.llama_tokenize(vocab, data, len(data), ids, len(ids), False, False)
        if n < 0:
            raise SystemExit(f"llama_tokenize needs {-n} tokens")
        result.append(list(ffi.unpack(ids, n)))
    lib.llama_model_free(model)
    print(json.dumps(result))


def _run(gguf_file: str, prompt: str, new_tokens: int) -> None:
    ffi, lib = _bindings()
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(gguf_file.encode(), lib.llama_model_default_params())
    if model == ffi.NULL:
        raise SystemExit(f"llama.cpp could not load {gguf_file}")
    params = lib.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_threads, params.n_threads_batch = 256, 256, 1, 1
    ctx = lib.llama_init_from_model(model, params)
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))

    def decode(ids: list[int]) -> list[float]:
        tokens = ffi.new("llama_token[]", ids)
        if lib.llama_decode(ctx, lib.llama_batch_get_one(tokens, len(ids))) != 0:
            raise SystemExit("llama_decode failed")
        return list(ffi.unpack(lib.llama_get_logits_ith(ctx, -1), n_vocab))

    logits = decode([int(t) for t in prompt.split(",")])
    first, generated = logits, []
    for _ in range(new_tokens):
        generated.append(max(range(n_vocab), key=logits.__getitem__))
        logits = decode([generated[-1]])
    lib.llama_free(ctx)
    lib.llama_model_free(model)
    print(json.dumps({"tokens": generated, "logits": first}))


if __name__ == "__main__":
    if sys.argv[1] == "--tokenize":
        _tokenize(sys.argv[2])
    else:
        _run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
