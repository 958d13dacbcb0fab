"""lm-evaluation-harness adapter: our model and tokenizer behind lm-eval's `LM` interface, so standard
tasks (hellaswag, arc, lambada, ...) run wherever the hub is reachable, and local YAML tasks run offline.

    from moe_core.eval.harness import MoELabLM, run_tasks
    lm = MoELabLM(model, tokenizer)
    results = run_tasks(lm, ["my_local_task"], include_path="tasks/lm_eval", limit=20)

Needs ``lm-eval`` (``pip install lm-eval``); importing this module without it raises ImportError saying so.
Requests are scored one at a time (no padding), which is exact and simple, and fast enough for the model
sizes this lab trains; tokenization follows lm-eval's HF model (trailing context spaces move to the
continuation, the continuation's tokens are those of ``context + continuation`` after the context's).

Legend: S = sequence, V = vocabulary, N = continuation tokens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from moe_core.errors import MoELabError

try:
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import LM
except ImportError as err:  # pragma: no cover - exercised only where lm-eval is absent
    raise ImportError("moe_core.eval.harness needs lm-evaluation-harness: pip install lm-eval") from err


class MoELabLM(LM):
    """`lm_eval.api.model.LM` over a `MoEForCausalLM` (or any causal LM with ``.logits``) and a tokenizer."""

    def __init__(self, model, tokenizer, max_length: int | None = None, max_gen_toks: int = 256) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.max_length = max_length or int(getattr(model.config, "max_position_embeddings", 2048))
        self.max_gen_toks = max_gen_toks
        self._device = next(model.parameters()).device
        eos = tokenizer.eos_token_id
        self.prefix_token_id = eos if eos is not None else tokenizer.bos_token_id
        if self.prefix_token_id is None:
            raise ValueError(
                "MoELabLM: the tokenizer has neither EOS nor BOS; lm-eval needs one to prefix empty contexts"
            )

    # ------------------------------------------------------------------ tokens
    def tok_encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not context:
            return [self.prefix_token_id], self.tok_encode(continuation)
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = self.tok_encode(context + continuation)
        context_enc = self.tok_encode(context)
        return context_enc, whole[len(context_enc) :]

    @torch.no_grad()
    def _score(self, context_enc: list[int], continuation_enc: list[int]) -> tuple[float, bool]:
        """Sum of log p(continuation | context) and whether greedy decoding would produce it."""
        if not continuation_enc:
            return 0.0, True
        ids = (context_enc + continuation_enc)[-(self.max_length + 1) :][:-1]
        ids_1S = torch.tensor([ids], device=self._device)
        logits_SV = self.model(ids_1S, use_cache=False).logits[0].float()
        n = len(continuation_enc)
        logprobs_NV = F.log_softmax(logits_SV[-n:], dim=-1)
        target_N = torch.tensor(continuation_enc, device=self._device)
        logprob = float(logprobs_NV.gather(1, target_N[:, None]).sum())
        greedy = bool((logprobs_NV.argmax(-1) == target_N).all())
        return logprob, greedy

    # ------------------------------------------------------------------ the LM interface
    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        out = []
        with _eval_mode(self.model):
            for request in requests:
                context, continuation = request.args
                result = self._score(*self._encode_pair(context, continuation))
                self.cache_hook.add_partial("loglikelihood", request.args, result)
                out.append(result)
        return out

    def loglikelihood_rolling(self, requests: Sequence[Any]) -> list[float]:
        out = []
        with _eval_mode(self.model):
            for request in requests:
                (text,) = request.args
                windows = lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
                total = sum(self._score(*lm_utils.make_disjoint_window(w))[0] for w in windows)
                self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
                out.append(total)
        return out

    @torch.no_grad()
    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        out = []
        with _eval_mode(self.model):
            for request in requests:
                context, gen_kwargs = request.args
                gen_kwargs = dict(gen_kwargs or {})
                until = gen_kwargs.pop("until", None) or []
                until = [until] if isinstance(until, str) else list(until)
                max_new = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
                do_sample = bool(gen_kwargs.pop("do_sample", False))
                temperature = float(gen_kwargs.pop("temperature", 0.0) or 0.0)
                if temperature == 0.0:
                    do_sample = False
                context_enc = self.tok_encode(context) or [self.prefix_token_id]
                context_enc = context_enc[-max(self.max_length - max_new, 1) :]
                ids_1S = torch.tensor([context_enc], device=self._device)
                kwargs = dict(
                    max_new_tokens=max_new,
                    do_sample=do_sample,
                    attention_mask=torch.ones_like(ids_1S),
                    eos_token_id=self.tokenizer.eos_token_id,
                    pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                )
                if do_sample:
                    kwargs["temperature"] = temperature
                else:
                    kwargs.update(temperature=None, top_k=None, top_p=None)
                new_S = self.model.generate(ids_1S, **kwargs)[0, len(context_enc) :]
                text = self.tokenizer.decode(new_S, skip_special_tokens=True)
                for stop in until:
                    if stop:
                        text = text.split(stop)[0]
                self.cache_hook.add_partial("generate_until", request.args, text)
                out.append(text)
        return out


class _eval_mode:
    """Eval mode for the duration of a block, the previous mode restored after."""

    def __init__(self, model) -> None:
        self.model = model

    def __enter__(self):
        self.was_training = self.model.training
        self.model.eval()

    def __exit__(self, *exc) -> None:
        self.model.train(self.was_training)


def run_tasks(
    lm: MoELabLM,
    tasks: Sequence[str],
    include_path: str | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """`lm_eval.simple_evaluate` on ``tasks`` (names, or names of YAML tasks under ``include_path``);
    returns its ``results`` dict (task -> metric -> value)."""
    # lazy: lm-eval's evaluator takes seconds to import; MoELabLM alone needs only lm_eval.api
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    task_manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    try:
        out = simple_evaluate(
            model=lm,
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=task_manager,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
            log_samples=False,
        )
    except (OSError, ConnectionError) as err:  # requests', huggingface_hub's and datasets' offline errors
        offline = (
            " (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set)"
            if os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
            else ""
        )
        raise MoELabError(
            f"lm-eval tasks {','.join(tasks)}: their data could not be loaded from the Hugging Face "
            f"hub{offline} ({type(err).__name__}); run where the hub is reachable, or give local "
            "YAML tasks with --include-path"
        ) from None
    return out["results"] if out else {}
