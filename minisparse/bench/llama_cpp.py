"""llama.cpp beside minisparse, in a child process: a crash of the comparison never kills ours.

llama.cpp comes from the optional ``llama-cpp-python`` package. Its native build can execute
instructions that a machine advertises but refuses (AMX tiles on some virtual Intel Xeons: a
general protection fault kills the whole process), so it runs in a child process, which loads
the GGUF file once and then decodes on request: the parent writes one JSON line (prompt, token
count), the child decodes greedily and answers one JSON line (its token ids and text). The
parent times each request, so the two engines still alternate within every repeat. If the
child dies, ``LlamaCppDied`` says how in one line, with the rebuild hint where the signal
points at illegal instructions, and the benchmark goes on without it.

Bytes per token: llama.cpp streams every tensor of the file once per decode step, except
``token_embd`` when the file has a separate ``output`` matrix (then only one embedding row is
read); with tied embeddings ``token_embd`` is the LM head and is read whole
(``gguf_step_bytes``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "REBUILD_HINT",
    "LlamaCppChild",
    "LlamaCppDied",
    "gguf_step_bytes",
]

REBUILD_HINT = (
    "a native llama-cpp-python build can use AMX or AVX-512 instructions this machine refuses; "
    'rebuild it with CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON '
    '-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" pip install --no-binary llama-cpp-python '
    "--force-reinstall llama-cpp-python (README: llama.cpp)"
)


class LlamaCppDied(RuntimeError):
    """The llama.cpp child process ended before answering (a crash, or an import error)."""


def gguf_step_bytes(path: str | Path) -> int:
    """Weight bytes llama.cpp reads per decode step of ``path`` (see the module docstring)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


@dataclass
class Completion:
    tokens: list[int]
    text: str


class LlamaCppChild:
    """llama.cpp decoding ``gguf`` greedily in a child process (see the module docstring).

    ``complete(prompt, n)`` returns the ``Completion``; ``close()`` ends the child (also on
    ``with`` exit). Raises ``LlamaCppDied`` when the child is gone.
    """

    def __init__(self, gguf: str | Path, threads: int, n_ctx: int = 512) -> None:
        self.gguf = Path(gguf)
        command = [sys.executable, "-m", "minisparse.bench.llama_cpp", str(gguf), str(threads)]
        self.stderr = tempfile.TemporaryFile("w+")  # a file, not a pipe: it never fills up
        self.proc = subprocess.Popen(
            [*command, str(n_ctx)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=os.environ | {"PYTHONUNBUFFERED": "1"},
        )
        try:
            self._read()  # "ready" once the model is loaded
        except BaseException:
            self.close()
            raise

    def _read(self) -> dict:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise LlamaCppDied(self._why())
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            self.close()
            raise LlamaCppDied(
                f"llama.cpp's process on {self.gguf.name} printed {line.strip()[:80]!r} "
                "instead of an answer"
            ) from None

    def _why(self) -> str:
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        err = []
        if not self.stderr.closed:
            self.stderr.seek(0)
            err = self.stderr.read().strip().splitlines()
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:  # a real-time signal has no name
                name = f"signal {-code}"
            hint = f"; {REBUILD_HINT}" if name in ("SIGILL", "SIGSEGV", "SIGBUS") else ""
            return f"llama.cpp died with {name} on {self.gguf.name}{hint}"
        last = err[-1] if err else "no message"
        return f"llama.cpp exited with status {code} on {self.gguf.name}: {last}"

    def complete(self, prompt: str, max_new_tokens: int) -> Completion:
        if self.proc.stdin is None or self.proc.poll() is not None:
            raise LlamaCppDied(self._why())
        try:
            self.proc.stdin.write(json.dumps({"prompt": prompt, "n": max_new_tokens}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise LlamaCppDied(self._why()) from None
        answer = self._read()
        return Completion(answer["tokens"], answer["text"])

    def close(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        if not self.stderr.closed:
            self.stderr.close()

    def __enter__(self) -> LlamaCppChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(gguf: str, threads: int, n_ctx: int) -> None:
    """The child's loop: load ``gguf``, say ready, answer one JSON line per request line."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_threads=threads, n_ctx=n_ctx, verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        llm.reset()
        tokens: list[int] = []
        eos = llm.token_eos()
        for token in llm.generate(llm.tokenize(request["prompt"].encode()), top_k=1, temp=0.0):
            if token == eos:
                break
            tokens.append(int(token))
            if len(tokens) == request["n"]:
                break
        text = llm.detokenize(tokens).decode("utf-8", errors="replace")
        print(json.dumps({"tokens": tokens, "text": text}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
