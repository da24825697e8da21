"""The vLLM-familiar Python API on the tiny model: n, RequestOutput-shaped results, dict
prompts, chat, get_tokenizer, use_tqdm, vLLM's SamplingParams spellings, type errors, options
refused before loading, and nothing left running when a caller abandons a request."""

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.sampling.params import SamplingTypeError

OPTS = dict(page_size=8, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, num_pages=200, **OPTS)


def assert_idle(llm):
    """Nothing running or queued, no page held (one step flushes pending aborts)."""
    llm.engine.step()
    assert not llm.engine.has_unfinished()
    assert llm.engine.pool.num_used_pages == 0


def test_results_have_vllm_shape_and_flat_fields(llm):
    out = llm.generate("hello", GREEDY)[0]
    assert out.prompt == "hello"
    assert out.prompt_token_ids == llm.get_tokenizer().encode("hello")
    assert len(out.outputs) == 1 and out.finished
    first = out.outputs[0]
    assert len(first.token_ids) == 6 and first.finish_reason == "length"
    assert (out.text, out.token_ids, out.finish_reason) == (
        first.text,
        first.token_ids,
        first.finish_reason,
    )
    assert out.metrics.ttft_s is not None and first.cumulative_logprob is None


def test_n_completions_share_the_prompt(llm):
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=8, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8, 9, 10, 11, 12, 13]], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({c.request_id for c in out.outputs}) == 3
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds 7, 8, 9 differ
    again = llm.generate([[5, 6, 7, 8, 9, 10, 11, 12, 13]], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    greedy = llm.generate("abc", SamplingParams(temperature=0, n=2, max_tokens=5))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert_idle(llm)


def test_dict_and_token_prompts_match_plain_ones(llm):
    ids = llm.get_tokenizer().encode("a dict prompt")
    outs = llm.generate(
        ["a dict prompt", {"prompt": "a dict prompt"}, {"prompt_token_ids": ids}, ids], GREEDY
    )
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == ["a dict prompt", "a dict prompt", None, None]
    with pytest.raises(TypeError, match="'prompt' .* or 'prompt_token_ids'"):
        llm.generate({"text": "x"}, GREEDY)
    with pytest.raises(TypeError, match=r"prompts\[1\]: expected a str"):
        llm.generate(["ok", 3.5], GREEDY)


def test_chat_renders_the_template(llm):
    messages = [{"role": "user", "content": "Hi!"}]
    out = llm.chat(messages, GREEDY)[0]
    assert out.prompt.endswith("<|assistant|>") and "Hi!" in out.prompt
    assert out.token_ids == llm.generate([messages], GREEDY)[0].token_ids
    two = llm.chat([messages, [{"role": "user", "content": "Bye"}]], GREEDY)
    assert len(two) == 2 and two[0].token_ids == out.token_ids
    with pytest.raises(TypeError, match="'role' \\(str\\) and 'content'"):
        llm.chat([{"role": "user"}])


def test_use_tqdm_counts_requests(llm):
    bars = []

    class Bar:
        def __init__(self, total, **_):
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=3, n=2), use_tqdm=Bar)
    assert (bars[0].total, bars[0].n, bars[0].closed) == (6, 6, True)
    llm.generate(["a"], GREEDY, use_tqdm=True)  # the real tqdm bar


def test_sampling_params_vllm_spellings():
    p = SamplingParams(top_k=-1, stop=None, stop_token_ids=None)
    assert (p.top_k, p.stop, p.stop_token_ids) == (0, (), ())
    assert SamplingParams(stop="###").stop == ("###",)
    assert (p.n, p.include_stop_str_in_output, p.skip_special_tokens) == (1, False, True)
    with pytest.raises(InvalidRequestError, match="top_k=-2"):
        SamplingParams(top_k=-2)
    with pytest.raises(InvalidRequestError, match="n=0"):
        SamplingParams(n=0)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("temperature", "0.5", r"a number \(float\)"),
        ("max_tokens", 2.0, "an int"),
        ("top_k", True, "an int"),
        ("seed", "1", "an int or None"),
        ("stop", [1], "str or list of str"),
        ("stop_token_ids", ["a"], "list of int"),
        ("ignore_eos", 1, "a bool"),
    ],
)
def test_sampling_params_type_errors_name_the_type(field, value, expected):
    with pytest.raises(TypeError, match=f"{field}=.*expected {expected}, got") as e:
        SamplingParams(**{field: value})
    assert isinstance(e.value, SamplingTypeError) and isinstance(e.value, InvalidRequestError)


def test_include_stop_str_in_output(llm):
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=16, ignore_eos=True)
    text = llm.generate("stop here", params)[0].text
    # the first two printable ASCII characters in a row that do not occur earlier
    start = next(
        i
        for i in range(1, len(text) - 1)
        if text[i : i + 2].isascii()
        and text[i : i + 2].isprintable()
        and text[i : i + 2] not in text[: i + 1]
    )
    stop = text[start : start + 2]
    cut = llm.generate("stop here", _replace(params, stop=stop))[0]
    kept = llm.generate("stop here", _replace(params, stop=stop, include_stop_str_in_output=True))
    assert (cut.text, cut.finish_reason) == (text[:start], "stop")
    assert (kept[0].text, kept[0].finish_reason) == (text[: start + 2], "stop")


@pytest.mark.compile
def test_skip_special_tokens_false_keeps_special_text(llm):
    base = SamplingParams(temperature=1.0, seed=3, n=16, max_tokens=48, ignore_eos=True)
    skipped = llm.generate([[7, 8, 9]], base)[0].outputs
    kept = llm.generate([[7, 8, 9]], _replace(base, skip_special_tokens=False))[0].outputs
    specials = {0: "<unk>", 1: "<s>", 2: "</s>"}
    with_special = [i for i, c in enumerate(kept) if set(c.token_ids) & set(specials)]
    assert with_special, "seed 3 should sample a special token somewhere in 768 tokens"
    for i in with_special:
        assert skipped[i].token_ids == kept[i].token_ids
        named = [specials[t] for t in kept[i].token_ids if t in specials]
        assert all(s in kept[i].text for s in named)
        assert not any(s in skipped[i].text for s in named)


def test_breaking_out_of_a_stream_aborts_it(llm):
    stream = llm.generate_stream("long", SamplingParams(max_tokens=200, ignore_eos=True))
    first = next(stream)
    assert not first.finished
    stream.close()  # what `break` in a for loop does when the generator is collected
    assert_idle(llm)
    for delta in llm.generate_stream("again", SamplingParams(max_tokens=200, ignore_eos=True)):
        assert not delta.finished
        break
    assert_idle(llm)


def test_failed_generate_aborts_what_it_added(llm):
    vocab = llm.model.config.vocab_size
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate([[5, 6, 7], [8, 9], [vocab + 5]], GREEDY)
    assert_idle(llm)


def test_interrupted_generate_aborts_the_rest(llm):
    class InterruptingBar:
        def __init__(self, **_):
            pass

        def update(self, k):
            raise KeyboardInterrupt

        def close(self):
            pass

    params = [GREEDY, SamplingParams(max_tokens=150, ignore_eos=True)]
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["short", "long"], params, use_tqdm=InterruptingBar)
    assert_idle(llm)


def test_options_are_refused_before_loading(monkeypatch):
    import models.registry

    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(models.registry, "load_model", no_load)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['gpu_mem'\]"):
        LLM("tiny", gpu_mem=0.5)
    with pytest.raises(TypeError, match="max_num_seqs expected int, got str"):
        LLM("tiny", max_num_seqs="8")
    with pytest.raises(InvalidRequestError, match="gpu_memory_utilization=1.5"):
        LLM("tiny", gpu_memory_utilization=1.5)
    with pytest.raises(InvalidRequestError, match="not both"):
        LLM("tiny", mesh="model:2", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="no such file or directory"):
        LLM("/no/such/model.gguf")


@pytest.mark.compile
def test_cpu_ignores_memory_fraction_and_tp1_is_one_device(tiny_model, caplog):
    llm = LLM(tiny_model, tensor_parallel_size=1, gpu_memory_utilization=0.9, num_pages=64)
    assert llm.engine.mesh is None
    assert "gpu_memory_utilization=0.9 ignored" in caplog.text
    assert llm.generate("x", GREEDY)[0].finish_reason == "length"


def _replace(p: SamplingParams, **kw) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(p, **kw)


def test_tensor_parallel_size_is_a_model_mesh():
    from engine.llm_options import mesh_from

    assert mesh_from(None, None) is None and mesh_from("data:2", None) == "data:2"
    assert mesh_from(None, 1) is None and mesh_from(None, 4) == "model:4"
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size=0"):
        mesh_from(None, 0)


def test_memory_fraction_sizes_the_kv_pool_from_device_memory(monkeypatch):
    import types

    import jax

    from configs.engine_config import EngineConfig
    from engine.llm_options import with_memory_fraction

    gib = 2**30
    device = types.SimpleNamespace(
        platform="gpu", memory_stats=lambda: {"bytes_limit": 80 * gib, "bytes_in_use": 20 * gib}
    )
    monkeypatch.setattr(jax, "local_devices", lambda: [device])
    config = with_memory_fraction(EngineConfig(model="tiny"), 0.9)
    assert config.kv_cache_bytes == 72 * gib - 20 * gib  # 0.9 x 80 GiB - weights in use
    with pytest.raises(InvalidRequestError, match="leaves no KV memory"):
        with_memory_fraction(EngineConfig(model="tiny"), 0.2)
    with pytest.raises(InvalidRequestError, match="not both"):
        with_memory_fraction(EngineConfig(model="tiny", num_pages=64), 0.9)
