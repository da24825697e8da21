"""ModelRunner: the one owner of the engine's device state and of the programs run on it.

    runner = ModelRunner(model, config, sched_config, impl=..., mesh=...)
    program = runner.program(built, bitmask)            which program a step runs
    packed = runner.run(batch, shape, program)          dispatch a step (results on device)
    runner.last_step_aux                                 that step's auxiliary output (MoE
                                                        expert load) on device, or None
    packed, spec_packed, num_accepted = runner.verify(batch, shape, spec, program)
                                                        a speculative step: drafts verified
    runner.compile(shape, program)                      build a program without running it
    runner.reset_slot(slot, prompt_ids, output_ids)     a request took a slot (penalty rows)

It holds the params (cast, sharded or laid out per layer) and one `DeviceState`
(engine/runner/state.py: KV cache, penalty counts, prompt mask, last tokens), which every
step program takes donated and returns; nothing else assigns it. Beside the steps, two
callers change the KV cache through `update_kv`: KV transfer's page import
(engine/kv_transfer/transfer.py) and the layers proposer, which drafts over the target's
own cache (engine/spec/layers.py). The LoRA slot stack (engine/lora/adapters.py
AdapterManager, None when max_loras is 0) is built here too: its rows ride in every step's
arguments.

The verify program (engine/spec/step.py spec_engine_step) is handed in by the core as
`verify_step`: engine/spec imports the runner, so the runner never imports engine/spec.

`run`, `reset_slot` and `compile` are the seams warm-up, benchmarks (a faked device) and
multi-host (engine/parallel/distributed.py LeaderRunner, which announces each call to the
other processes) call, fake or override. Programs built after warm-up are logged once
each (`check_compiles`: what the server's pagedjax_compiles_after_warmup_total counts).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from configs.engine_config import EngineConfig
from engine.batch.builder import BatchShape, BuiltStep, StepBatch
from engine.lora.adapters import AdapterManager
from engine.parallel import sharding
from engine.runner import compiles, penalties
from engine.runner.kv_cache import PagedKVCache, WindowedKVCache
from engine.runner.programs import GREEDY_PROGRAM, StepProgram
from engine.runner.shapes import sampler_variants
from engine.runner.state import DeviceState
from engine.runner.step import engine_step
from engine.sampling.sampler import FULL_FLAGS, SamplingFlags
from engine.structured.matcher import bitmask_width
from models.llama import LayerWeights, cast_params, layer_layout
from models.lora import LoraInputs

log = logging.getLogger("engine.core")  # NOTE: the logger these warnings always had


class ModelRunner:
    """Params, device state and step programs of one EngineCore (see the module docstring)."""

    def __init__(
        self,
        model,
        config: EngineConfig,
        sched_config,
        *,
        impl: str = "auto",
        mesh=None,
        verify_step=None,
    ):
        """`model`: the engine's LoadedModel; `mesh`: None or the engine's ("data", "model")
        mesh (engine/parallel/sharding.py engine_mesh); `verify_step`: the jitted verify
        program of speculative decoding (None: `verify` is refused)."""
        self.config, self.sched_config = config, sched_config
        self.impl, self.mesh, self.verify_step = impl, mesh, verify_step
        self.cfg = model.config  # as the engine runs it (a mesh may replicate KV heads)
        self.params = cast_params(model.params, config.dtype)
        if mesh is not None:  # Megatron layout; cfg.num_kv_heads may grow (replication)
            self.cfg, self.params = sharding.shard_params(self.params, self.cfg, mesh)
            kv_sharding = sharding.kv_sharding(mesh, self.cfg)
            self.device = None
        else:  # NOTE: committed, like loaded params: an uncommitted cache is another jit cache
            # key, so the first warm-up shape would compile again on first use.
            kv_sharding = self.device = next(iter(jax.tree.leaves(self.params)[0].devices()))
            self.params = layer_layout(self.params, config.layer_loop)
        ring = config.local_ring_pages(self.cfg)  # release_local_pages: K/V per layer group
        if ring is not None and mesh is not None:
            raise NotImplementedError("release_local_pages with a mesh (model sharding)")
        if ring is None:
            kv = PagedKVCache.zeros(
                self.cfg, sched_config.num_pages, sched_config.page_size, config.kv_dtype,
                sharding=kv_sharding,
            )  # fmt: skip
        else:
            kv = WindowedKVCache.zeros(
                self.cfg, sched_config.num_pages, sched_config.page_size,
                sched_config.max_num_seqs, ring, config.kv_dtype, sharding=kv_sharding,
            )  # fmt: skip
        # With a mesh: replicated, as the step returns them (the KV spec would not fit).
        self._place = (
            (lambda x: jax.device_put(x, kv_sharding))
            if mesh is None
            else (lambda x: sharding.replicate(x, mesh))
        )
        # The token counts exist from the start (the "full" sampler program always applies
        # penalties), so every step program has one signature.
        self.state = DeviceState.without_penalties(kv, sched_config.max_num_seqs, self._place)
        self._penalties_ready = False
        if mesh is None:  # NOTE: see full_program for the mesh case
            self.init_penalties()
        self._all_allowed: dict[int, np.ndarray] = {}  # rows -> all-ones token bitmask
        self.adapters = self._adapter_manager(model, kv_sharding)
        # NOTE: the aux output of the last `run` (engine/runner/step.py; None for a family
        # without one): kept here so `run` still returns only the packed results, the value
        # the fakes (benchmarks) and the multi-host leader pass through.
        self.last_step_aux: jax.Array | None = None
        self.warmup_s: float | None = None
        self._compiles_at_warmup: int | None = None
        self._logged_compiles = 0

    def _adapter_manager(self, model, device_or_sharding) -> AdapterManager | None:
        """The LoRA slot stack (None: EngineConfig.max_loras is 0)."""
        if not self.config.max_loras:
            return None
        return AdapterManager(
            model.config,
            self.cfg,
            max_loras=self.config.max_loras,
            max_lora_rank=self.config.max_lora_rank,
            max_num_seqs=self.sched_config.max_num_seqs,
            dtype=self.params.embed.dtype,
            mesh=self.mesh,
            device=None if self.mesh is not None else device_or_sharding,
            unrolled=not isinstance(self.params.layers, LayerWeights),
        )

    def load_params(self, params) -> None:
        """Other weights of the same architecture (EngineCore.reload_model; one device)."""
        self.params = layer_layout(cast_params(params, self.config.dtype), self.config.layer_loop)

    # ---- which program a step runs --------------------------------------------------------
    def program(self, built: BuiltStep, bitmask: np.ndarray | None) -> StepProgram:
        """The program of a step: "greedy" (argmax only) when the shape is decode-only and
        every row is greedy, unconstrained, without logprobs or penalties; else "full",
        which always applies penalties (neutral for rows without) and a token bitmask (all
        tokens allowed when no row is constrained), so one program per shape serves every
        other request (engine/runner/shapes.py sampler_variants). NOTE: flags never change
        a row's token."""
        greedy_ok = "greedy" in sampler_variants(built.shape) or self.mesh is not None
        if greedy_ok and not (built.full_sampler or built.penalties or bitmask is not None):
            return GREEDY_PROGRAM
        program = self.full_program(built.shape)
        return StepProgram(
            FULL_FLAGS,
            program.use_penalties or built.penalties,
            program.token_bitmask if bitmask is None else bitmask,
        )

    def full_program(self, shape: BatchShape) -> StepProgram:
        """The "full" program an unconstrained step of `shape` runs.
        NOTE: with a mesh the sampler programs stay as they were before the shape set was
        made small (greedy on every shape, penalties and the bitmask variants of their own,
        compiled on first use, token counts allocated on first use): the sharded step's
        full sampler crashed XLA:CPU's compiler on a greedy workload (an
        optimization_barrier cast check, tests/test_multihost.py); not investigated."""
        if self.mesh is not None:
            return StepProgram(FULL_FLAGS, False, None)
        return StepProgram(FULL_FLAGS, True, self.all_allowed(shape))

    def all_allowed(self, shape: BatchShape) -> np.ndarray:
        """[Sd + Sp, ceil(V/32)] int32 all ones: the full program's bitmask when no row is
        constrained (numpy, like structured output's own masks: one jit signature)."""
        rows = shape.num_decode + shape.num_prefill_seqs
        mask = self._all_allowed.get(rows)
        if mask is None:
            mask = np.full((rows, bitmask_width(self.cfg.vocab_size)), -1, np.int32)
            mask.flags.writeable = False
            self._all_allowed[rows] = mask
        return mask

    # ---- running and building programs ----------------------------------------------------
    def run(self, batch, shape: BatchShape, program: StepProgram) -> jax.Array:
        """Dispatch one step of `batch` (a StepBatch or its PackedBatch); returns the packed
        results [Sd + Sp, 2 + 2K] on device without waiting for them (and keeps the step's
        auxiliary output in `last_step_aux`)."""
        self.state, packed, self.last_step_aux = engine_step(
            self.params,
            self.state,
            batch.pack() if isinstance(batch, StepBatch) else batch,
            **self._static_args(shape, program.flags, program.use_penalties),
            lora=self.lora_inputs(batch if isinstance(batch, StepBatch) else None, shape),
            **_bitmask_arg(program.token_bitmask),
        )
        return packed

    def verify(
        self, batch: StepBatch, shape: BatchShape, spec, program: StepProgram, draft_probs=None
    ) -> tuple:
        """Dispatch a speculative step: `batch`'s plain rows sampled as `run` samples them,
        and the drafts of `spec` (engine/spec/step.py SpecBatch) verified. Returns (packed,
        spec_packed, num_accepted) on device. `draft_probs` [Sv, k, V]: a model proposer's
        q (drafts on device); None: point-mass drafts (ngram)."""
        if self.verify_step is None:
            raise RuntimeError("verify: this runner was built without speculative decoding")
        self.state, *results = self.verify_step(
            self.params,
            self.state,
            batch.pack(),
            spec,
            **self._verify_args(shape, program, draft_probs),
            lora=self.lora_inputs(batch, shape),
        )
        return tuple(results)

    def compile(self, shape: BatchShape, program: StepProgram, spec=None, draft_probs=None):
        """Build the step program of `shape` (or, with `spec`, its verify program) without
        running it: `jit.lower(...).compile()` fills the cache a call then uses (compiled,
        or loaded from the persistent cache). `spec`/`draft_probs` may hold
        jax.ShapeDtypeStruct leaves (values that arrive on device)."""
        batch = StepBatch.zeros(shape).pack()
        if spec is not None:
            lowered = self.verify_step.lower(
                self.params, self.state, batch, spec,
                **self._verify_args(shape, program, draft_probs),
                lora=self.lora_inputs(None, shape),
            )  # fmt: skip
        else:
            lowered = engine_step.lower(
                self.params,
                self.state,
                batch,
                **self._static_args(shape, program.flags, program.use_penalties),
                lora=self.lora_inputs(None, shape),
                **_bitmask_arg(program.token_bitmask),
            )
        lowered.compile()

    def _static_args(self, shape: BatchShape, flags: SamplingFlags, use_penalties: bool) -> dict:
        return dict(
            cfg=self.cfg,
            shape=shape,
            flags=flags,
            use_penalties=use_penalties,
            impl=self.impl,
            mesh=self.mesh,
        )

    def _verify_args(self, shape: BatchShape, program: StepProgram, draft_probs) -> dict:
        return dict(
            cfg=self.cfg,
            shape=shape,
            flags=program.flags,
            use_penalties=program.use_penalties,
            impl=self.impl,
            draft_probs=draft_probs,
            mesh=self.mesh,
        )

    def lora_inputs(self, batch: StepBatch | None, shape: BatchShape) -> LoraInputs | None:
        """The adapter stack and each token row's slot for `batch` (None: padding rows);
        None without adapters."""
        return None if self.adapters is None else self.adapters.inputs(batch, shape)

    # ---- state outside the steps ----------------------------------------------------------
    def update_kv(self, fn, *args, **kwargs):
        """`fn(kv, *args, **kwargs)` returns the new KV cache, or a tuple (kv, *outputs): a
        jitted function that takes the cache donated. The runner keeps the new cache and
        returns the outputs (None when `fn` returned only the cache)."""
        out = fn(self.state.kv, *args, **kwargs)
        kv, rest = (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, None)
        self.state = dataclasses.replace(self.state, kv=kv)
        return rest

    def init_penalties(self) -> None:
        """Allocate the [max_num_seqs, V] token counts (at once on one device; with a mesh on
        first use or at warm-up)."""
        if not self._penalties_ready:
            num_slots, vocab = self.sched_config.max_num_seqs, self.cfg.vocab_size
            self.state = penalties.with_penalties(self.state, num_slots, vocab, self._place)
            self._penalties_ready = True

    def reset_slot(self, slot: int, prompt_token_ids, output_token_ids) -> None:
        """A request with these tokens took `slot`: its penalty rows are rewritten (the
        counts are allocated first if they are not yet)."""
        self._reset_slot(slot, prompt_token_ids, output_token_ids)

    def _reset_slot(self, slot: int, prompt_token_ids, output_token_ids) -> None:
        self.init_penalties()
        width = self.sched_config.max_model_len
        self.state = penalties.reset_slot(
            self.state, slot, prompt_token_ids, output_token_ids, width
        )

    def warm_reset(self) -> None:
        """Allocate the token counts and run the slot reset once (slot 0, empty lists: the
        slot a real request takes is reset again when it does). Not announced to other
        processes (LeaderRunner): each builds its own."""
        self._reset_slot(0, [], [])
        jax.block_until_ready(self.state.counts)

    # ---- compiles after warm-up (engine/runner/compiles.py) -------------------------------
    def mark_warm(self, warmup_s: float) -> None:
        """Called by warm-up (engine/runner/warmup.py): programs built from now on are
        counted as compiles after warm-up."""
        self.warmup_s = warmup_s
        self._compiles_at_warmup = compiles.count()
        self._logged_compiles = 0

    def compiles_after_warmup(self) -> int | None:
        """Programs built since `mark_warm` (None before it)."""
        if self._compiles_at_warmup is None:
            return None
        return compiles.count() - self._compiles_at_warmup

    def check_compiles(self, shape: BatchShape, flags: SamplingFlags) -> None:
        """Logs each program built after warm-up once, with the step that built it."""
        after = self.compiles_after_warmup()
        if after is not None and after > self._logged_compiles:
            log.warning(
                "%d program(s) compiled after warm-up (step shape %s, %s sampler)",
                after - self._logged_compiles,
                shape,
                "greedy" if flags.all_greedy else "full",
            )
            self._logged_compiles = after

    @property
    def kv_bytes(self) -> int:
        return self.state.kv.num_bytes

    @property
    def pool_kv_bytes(self) -> int:
        """Bytes of the KV the page pool's pages index (with release_local_pages: the
        global layers' cache; the local rings are reserved per slot)."""
        kv = self.state.kv
        return (kv.full if isinstance(kv, WindowedKVCache) else kv).num_bytes

    @property
    def weights_bytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.params))


def _bitmask_arg(token_bitmask: np.ndarray | None) -> dict:
    # NOTE: passed only when set: an explicit None is another jit cache key than the
    # default, so warm-up's programs would not be found.
    return {} if token_bitmask is None else {"token_bitmask": token_bitmask}
