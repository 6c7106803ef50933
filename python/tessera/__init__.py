"""tessera: long-context LLM inference whose attention is a mosaic of sparse patterns.

Quick start::

    import tessera
    model = tessera.Model.load("smollm2-135m-instruct-q4_1.gguf")
    engine = tessera.Engine(model, attn="trianglemix", device="cpu")
    for piece in engine.generate([{"role": "user", "content": "Hi!"}], max_tokens=32, stream=True):
        print(piece, end="", flush=True)
    print(engine.stats())

``tessera.ops`` holds the attention kernels as PyTorch custom ops and ``tessera.hf`` patches Hugging Face
``transformers`` models; both import torch, the rest of the package does not.
"""

from __future__ import annotations

# Typing names under private aliases: the package's namespace (dir(tessera)) is its API only.
from typing import Mapping as _Mapping, Sequence as _Sequence, Union as _Union

from . import _tessera
from ._tessera import Error, Generation, Model, Policy, check_attn_spec

__all__ = ["Model", "Engine", "Policy", "Error", "Generation", "check_attn_spec", "built_with_cuda", "ops", "hf"]

#: The version of tessera (the project's, from CMakeLists.txt: the same as ``tessera --version``).
__version__: str = _tessera.__version__

#: Whether this build of the module has the CUDA backend and the GPU engine.
built_with_cuda: bool = _tessera.built_with_cuda

_Message = _Mapping[str, str]
_Prompt = _Union[str, _Sequence[int], _Sequence[_Message]]


def _bias_list(logit_bias) -> list[tuple[int, float]]:
    """{token id: bias} (ids as ints or integer strings, as OpenAI's logit_bias) -> [(id, bias)]."""
    if logit_bias is None:
        return []
    if not isinstance(logit_bias, _Mapping):
        raise TypeError("logit_bias must be a mapping of token ids to biases")
    return [(int(k), float(v)) for k, v in logit_bias.items()]


class Engine:
    """One sequence's inference over a loaded model: chunked prefill under an attention policy, then decode.

    ``attn`` is what ``tessera run --attn`` takes (``"dense"``, ``"ashape:sink=64,local=1024"``, ``"vs"``,
    ``"trianglemix"``, the path of a policy file, ...) or a :class:`tessera.Policy`. ``device`` is ``"cpu"``,
    ``"cuda"`` (the GPU engine: bf16 weights on the device) or ``"auto"``. ``max_context`` limits the tokens the
    cache may hold (0: the model's context); ``chunk`` is the prefill chunk (0: the engine's default).
    ``streaming`` reads prompts of any length through streaming memory (docs/streaming.md), as ``tessera run
    --stream`` does: a method (``"ltri"``, ``"infllm"``, ``"streamingllm"``) or a dict with ``"method"`` and the
    sizes of ``--stream-*`` (``sinks``, ``local``, ``chunk``, ``block``, ``top_k``, ``last_chunk``, ``host_budget``
    (bytes or ``"4G"``), ``retrieval_heads`` (a file), ``index_ratio``, ``index_heads`` (``"retrieval"``, the default, or ``"all"``), ``early_layers`` (``"score"``, the default, or
    ``"votes"``), ``map_heads`` (``"all"``, the default, or ``"retrieval"``)); ``attn`` must then be ``"dense"``, and
    there is no context limit but ``max_context`` when given.
    Several engines may share one model. An engine is not meant for concurrent use: each ``generate`` starts a
    new sequence, and a stream still being read from an earlier call raises tessera.Error when resumed.
    """

    def __init__(self, model: Model, attn: _Union[str, Policy] = "dense", device: str = "cpu",
                 max_context: int = 0, chunk: int = 0, streaming: _Union[None, str, _Mapping] = None) -> None:
        if not isinstance(model, Model):
            raise TypeError(f"model must be a tessera.Model, got {type(model).__name__}")
        self.model = model
        self.attn = attn
        self.streaming = streaming
        self._engine = _tessera._Engine(model, attn, device, max_context, chunk,
                                        dict(streaming) if isinstance(streaming, _Mapping) else streaming)

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda"``: where this engine runs."""
        return self._engine.device

    @property
    def max_context(self) -> int:
        return self._engine.max_context

    def generate(self, prompt: _Prompt, *, max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stream: bool = False, chat: bool | None = None,
                 system: str | None = None, stop: str | _Sequence[str] | None = None, min_p: float = 0.0,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logit_bias: _Mapping[int, float] | None = None) -> _Union[str, Generation]:
        """Generates a reply to ``prompt`` (a new sequence each call).

        ``prompt``: text (plain, or one chat user turn with ``chat=True`` and an optional ``system`` message), a
        list of ``{"role", "content"}`` messages (the model's chat template), or a list of token ids.
        Sampling: ``temperature`` 0 is greedy; otherwise top-k (0: off), then top-p (1: off), drawn from a
        generator seeded with ``seed`` (same seed, same text). Generation ends at an end-of-turn token, after
        ``max_tokens`` tokens (-1: no limit), at the context limit, or at a stop sequence.

        Penalties and filters, as Hugging Face transformers' logits processors in its order (the server's fields of
        the same names): ``logit_bias`` ({token id: bias}, added to the logits), ``repetition_penalty`` (> 0, 1: off;
        over the prompt's and the reply's tokens), ``presence_penalty`` / ``frequency_penalty`` (0: off; OpenAI's,
        over the reply's tokens), all of them greedy too; then, when sampling, ``min_p`` (0: off) after top-p.

        ``stop``: a string or a list of strings, as the server's (and OpenAI's) ``stop``: generation ends when one
        appears in the text, and the text returned is what precedes it (the sequence itself and anything after it
        are not returned; streamed pieces hold back a tail that could still become one). ``finish_reason`` is then
        ``"stop"``; ``tokens`` holds every sampled token, the stop sequence's included.

        Returns the text, or with ``stream=True`` a :class:`tessera.Generation`: an iterator of text pieces whose
        ``tokens`` and ``finish_reason`` (``"stop"``, ``"length"``, ``"context"``) fill in as it runs.
        """
        if stop is None:
            stops: list[str] = []
        elif isinstance(stop, str):
            stops = [stop]
        else:
            stops = list(stop)
            if not all(isinstance(s, str) for s in stops):
                raise TypeError("stop must be a string or a list of strings")
        ids = self.model.encode(prompt, chat=chat, system=system)
        gen = self._engine.start(ids, max_tokens, temperature, top_k, top_p, seed, stops, min_p, repetition_penalty,
                                 presence_penalty, frequency_penalty, _bias_list(logit_bias))
        if stream:
            return gen
        return "".join(gen)

    def generate_batch(self, prompts: _Sequence[_Prompt], *, max_tokens: int = 128, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool | None = None,
                       system: str | None = None, parallel: int = 0, min_p: float = 0.0,
                       repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                       logit_bias: _Mapping[int, float] | None = None) -> list[str]:
        """Generates a reply to each of ``prompts`` at once, through the batched engine on this engine's device
        (continuous batching: up to ``parallel`` sequences run together, 0: all of them, at most 64; their decode
        steps are one batch), with this engine's policy, context and streaming options.

        Each prompt is what :meth:`generate` takes, and each reply is the text :meth:`generate` returns for that
        prompt alone with the same arguments (greedy, or sampled from ``seed``). ``max_tokens`` is clamped to what
        the context leaves after each prompt. Returns the texts in the order of ``prompts``.
        """
        if isinstance(prompts, (str, bytes)):
            raise TypeError("generate_batch takes a list of prompts; for one prompt use generate()")
        ids = [self.model.encode(p, chat=chat, system=system) for p in prompts]
        return self._engine.generate_batch(ids, max_tokens, temperature, top_k, top_p, seed, parallel, min_p,
                                           repetition_penalty, presence_penalty, frequency_penalty,
                                           _bias_list(logit_bias))

    def logits(self, ids: _Sequence[int]) -> list[float]:
        """Prefills ``ids`` as a new sequence and returns the last position's logits (a list of vocab floats)."""
        return self._engine.logits(list(ids))

    def stats(self) -> dict:
        """Tokens and seconds since the engine was made (or ``reset_stats``): prefill and decode counts, times
        and rates, and the attention and GEMM seconds within them."""
        return self._engine.stats()

    def streaming_stats(self) -> dict | None:
        """With ``streaming``: what the streaming memory holds after the last call (``evicted_blocks`` per layer,
        ``host_bytes``, ``index_vectors``, ``index_bytes``, ``index_spans``, ``workspace_tokens`` (the most keys a
        chunk attended), ``retrieval_seconds``, and ``retrieved``: per layer, the blocks its last chunk attended);
        None without."""
        return self._engine.streaming_stats()

    def reset_stats(self) -> None:
        self._engine.reset_stats()

    def memory(self) -> dict:
        """Bytes held: the weights, the KV cache; on CUDA also scratch, the peak in use and the device's total."""
        return self._engine.memory()

    def __repr__(self) -> str:
        attn = self.attn if isinstance(self.attn, str) else repr(self.attn)
        if self.streaming is not None:
            method = self.streaming if isinstance(self.streaming, str) else self.streaming.get("method")
            return f"<tessera.Engine {self.model.name} streaming={method!r} device={self.device!r}>"
        return f"<tessera.Engine {self.model.name} attn={attn!r} device={self.device!r}>"


def __dir__() -> list[str]:
    # The API (__all__, ops and hf included before their first import) and the module's own dunders.
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__") and n.endswith("__")})


def __getattr__(name: str):
    # tessera.ops and tessera.hf import torch: loaded on first use only.
    if name in ("ops", "hf"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'tessera' has no attribute {name!r}")
