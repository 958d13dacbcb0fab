"""The GGUF file's tokenizer (issue 32, GGUF): ``tokenizer.ggml.pre`` names the llama.cpp pre-tokenizer that splits
text as the checkpoint's tokenizer.json does, for the lab's own tokenizer and each published family's, and
llama.cpp itself (the prebuilt 0.4.17 engine of `tests/llama_cpp_engine.py`) tokenizes tricky text to the Hugging
Face ids; what llama.cpp cannot split the same way is refused before any weight is read.

No published tokenizer can be downloaded here, so each family's is rebuilt: its ``pre_tokenizer`` as the published
tokenizer.json writes it (below, with where each was read), a small BPE vocabulary trained through it with the
`tokenizers` library. The patterns are written out here, not imported from the module under test."""

from __future__ import annotations

import json
import shutil

import gguf
import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from moe_core import MoEForCausalLM, get_config
from moe_core.convert import to_hf
from moe_core.inference.gguf_export import GGUFExportError, export_gguf

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

VOCAB = 768  # the model's
TOKENIZER_VOCAB = 700  # 256 bytes, 3 specials, the merges


def _byte_level(*splits: dict) -> dict:
    return {
        "type": "Sequence",
        "pretokenizers": [
            *splits,
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


# The published pre_tokenizers. Qwen2's, Llama-3's and o200k's regexes: llama.cpp src/llama-vocab.cpp, the
# "original regex from tokenizer.json" comments of LLAMA_VOCAB_PRE_TYPE_QWEN2 / LLAMA3 / GPT4O (ggml-org/llama.cpp
# 00ad355e). DeepSeek-V3's three Splits: its tokenizer.json as quoted byte for byte in other projects' tests
# (e.g. the "hf_dir_identifies_deepseek_v3_from_tokenizer_json" fixture), the same as llama.cpp's DEEPSEEK3_LLM
# list. DeepSeek-LLM / V2's: llama.cpp's DEEPSEEK_LLM list (five Splits and \p{N}+, i.e. Digits without
# individual_digits). GPT-NeoX / OLMoE's: a plain ByteLevel with its GPT-2 regex (transformers' GPTNeoXConverter).
QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501
O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEEPSEEK_V3 = json.loads(
    r"""[{"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
    {"type": "Split", "pattern": {"Regex": "[一-龥぀-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": false},
    {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false}]"""  # noqa: E501
)
DEEPSEEK_LLM = [
    _split("[\r\n]"),
    _split(
        "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+"  # noqa: E501, RUF001
    ),
    _split(r"\s?[!-/:-~！-／：-～‘-‟　-。]+"),  # noqa: RUF001
    _split(r"\s+$"),
    _split("[一-龥ࠀ-一가-퟿]+"),
    {"type": "Digits", "individual_digits": False},
]
GPT_NEOX = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}

# case: (preset, HF architecture, config overrides, pre_tokenizer, normalizer, model.ignore_merges, llama.cpp name)
FAMILIES = {
    "lab": ("shared-tiny", "qwen2_moe", {}, None, None, False, "gpt-2"),  # moe_core.data.tokenizer's own
    "olmoe": ("olmoe-tiny", "olmoe", dict(num_key_value_heads=4), GPT_NEOX, None, False, "olmo"),
    "qwen2_moe": (
        "shared-tiny",
        "qwen2_moe",
        {},
        _byte_level(_split(QWEN2)),
        {"type": "NFC"},
        False,
        "qwen2",
    ),
    "qwen3_moe": ("qwen3-tiny", "qwen3_moe", {}, _byte_level(_split(QWEN2)), {"type": "NFC"}, False, "qwen2"),
    "deepseek_v3": (
        "deepseek-tiny",
        "deepseek_v3",
        {},
        _byte_level(*DEEPSEEK_V3),
        {"type": "Sequence", "normalizers": []},
        False,
        "deepseek-v3",
    ),
    "deepseek_v2": (
        "deepseek-tiny",
        "deepseek_v2",
        dict(  # DeepSeek-V2's routing, as tests/test_gguf_families.py
            router_score="softmax",
            router_group_score="max",
            norm_topk_prob=False,
            router_bias_update_rate=0.0,
            router_groups=1,
            router_topk_groups=1,
        ),
        _byte_level(*DEEPSEEK_LLM),
        None,
        False,
        "deepseek-llm",
    ),
    "gpt_oss": ("gptoss-tiny", "gpt_oss", {}, _byte_level(_split(O200K)), None, False, "gpt-4o"),
    "glm4_moe": ("glm4moe-tiny", "glm4_moe", {}, _byte_level(_split(LLAMA3)), None, False, "glm4"),
    "llama3": ("shared-tiny", "qwen2_moe", {}, _byte_level(_split(LLAMA3)), None, True, "llama-bpe"),
    # GLM-4.5's regexes with Llama-3's ignore_merges: still "glm4" in a glm4_moe checkpoint (the converter's name)
    "glm4_moe_ignore_merges": (
        "glm4moe-tiny",
        "glm4_moe",
        {},
        _byte_level(_split(LLAMA3)),
        None,
        True,
        "glm4",
    ),
}
# the names the prebuilt llama.cpp of tests/llama_cpp_engine.py (llama-cpp-cffi 0.4.17, early 2025) has:
# it predates "gpt-4o" and "glm4" (it refuses to load them: "unknown pre-tokenizer type")
ENGINE_NAMES = ("gpt-2", "olmo", "qwen2", "deepseek-v3", "deepseek-llm", "llama-bpe")

CORPUS = [
    "Don't stop: I'll go, you're right, they've said we'd 've'.",
    "The QUICK brown fox's 3.14159 jumps over 1234567890 lazy dogs!!",
    "def f(x):\n    return x * 42 + y[0]  # comment\n\n\n",
    "日本語のテキストと中文混合 한국어 text",
    "Ωμέγα ñandú café naïve — “quoted” ‘text’",
    "HelloWorld CamelCase ABCdef snake_case kebab-case",
    "a  b   c\t\td\r\ne    f",
    "?!... (nested [brackets] {braces}) <tags/> &amp; $100 50% @user #tag",
    "テキストabc漢字x naq\u0308ve q\u0301",  # kana / ideographs next to Latin; combining marks
]
TRICKY = [
    "don't stop: I'll go, you're 12345678 apples!!",
    "a  b   c\n\n\nd\t\te",
    "日本語のテキスト 和 中文 한국어",
    "x=(1+2)*3; y = [4,5]",
    "   leading",
    "trailing   ",
    "?!... hi",
    "The QUICK brown fox's 3.14159",
    "HelloWorld ABCdef CAPS'S",
    "line1\r\nline2\n  indented",
    "Ωμέγα ñandú — “q”",
    "テキストabc漢字x naq\u0308ve",  # a combining mark without a precomposed form: NFC (Qwen's) keeps it
]


def _family_tokenizer(
    pre_tokenizer: dict, normalizer: dict | None, ignore_merges: bool
) -> PreTrainedTokenizerFast:
    """A byte-level BPE with the given published pre_tokenizer. Its merges are learnt through a coarser one (words
    with their leading space, whitespace runs), so the vocabulary also has tokens across the boundaries the family
    splits at ("123", "I'll", "HelloWorld", "([", ...): a pre-tokenizer that splits elsewhere than the family's
    then gives other ids, which the llama.cpp test sees (a vocabulary learnt through the family's own splits only
    would tokenize alike under several of them)."""
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": normalizer,
        "pre_tokenizer": _byte_level(_split(r" ?\S+|\s+")),
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "ignore_merges": ignore_merges, "vocab": {}, "merges": []},
    }
    tok = Tokenizer.from_str(json.dumps(spec))
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        min_frequency=1,
        special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    trained = json.loads(tok.to_str())
    trained["pre_tokenizer"] = pre_tokenizer
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(trained)),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory):
    """Each case's tokenizer saved as a transformers tokenizer directory, once."""
    from moe_core.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("tokenizers")
    for case, (_, _, _, pre, normalizer, ignore_merges, _) in FAMILIES.items():
        if pre is None:
            tok = train_tokenizer(CORPUS * 4, vocab_size=TOKENIZER_VOCAB, min_frequency=1)
        else:
            tok = _family_tokenizer(pre, normalizer, ignore_merges)
        tok.save_pretrained(root / case)
    return root


def _hf_dir(tmp_path, preset, arch, overrides, tokenizer_dir):
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config(preset, vocab_size=VOCAB, **overrides))
    return to_hf(model, tmp_path / "hf", architecture=arch, tokenizer_dir=tokenizer_dir)


def _field(reader, key):
    field = reader.fields[key]
    return bytes(field.parts[field.data[0]]).decode()


def test_the_published_pre_tokenizers_really_are_rebuilt(tokenizers_dir):
    """The rebuilt tokenizers split as their families do (else the tests below check nothing): a few pieces."""
    pieces = {
        case: [
            p
            for p, _ in Tokenizer.from_file(
                str(tokenizers_dir / case / "tokenizer.json")
            ).pre_tokenizer.pre_tokenize_str("I'll pay 12345 HelloWorld")
        ]
        for case in ("lab", "qwen2_moe", "deepseek_v3", "gpt_oss", "glm4_moe")
    }
    assert pieces["lab"][:3] == ["I", "'ll", "Ġpay"] and "Ġ12345" in pieces["lab"]
    assert ["1", "2", "3", "4", "5"] == [p for p in pieces["qwen2_moe"] if p.isdigit()]
    assert ["123", "45"] == [p for p in pieces["deepseek_v3"] if p.isdigit()]
    assert "ĠHello" in pieces["gpt_oss"] and "World" in pieces["gpt_oss"]  # o200k splits at a case change
    assert "ĠHelloWorld" in pieces["glm4_moe"] and ["123", "45"] == [
        p for p in pieces["glm4_moe"] if p.isdigit()
    ]


@pytest.mark.parametrize("case", list(FAMILIES))
def test_gguf_names_the_pre_tokenizer_llama_cpp_splits_the_same_way(case, tmp_path, tokenizers_dir):
    preset, arch, overrides, _, _, _, name = FAMILIES[case]
    hf = _hf_dir(tmp_path, preset, arch, overrides, tokenizers_dir / case)
    export_gguf(hf, tmp_path / "model.gguf")
    reader = gguf.GGUFReader(tmp_path / "model.gguf")
    assert _field(reader, "tokenizer.ggml.pre") == name
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"pre_tokenizer": {"type": "Whitespace"}}, r"step \{\"type\": \"Whitespace\"\} has no llama.cpp"),
        ({"pre_tokenizer": _byte_level(_split(r"\p{N}{1,2}"))}, r"matches none of llama.cpp's.*qwen2"),
        (
            {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}},
            "adds a prefix space",
        ),
        ({"normalizer": {"type": "Lowercase"}}, "do not normalize"),
        (
            {"pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first"}},
            "SentencePiece-style.*convert_hf_to_gguf",
        ),
        (  # Mixtral's published tokenizer.json spells spaces in its normalizer
            {
                "normalizer": {
                    "type": "Sequence",
                    "normalizers": [
                        {"type": "Prepend", "prepend": "\u2581"},
                        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
                    ],
                }
            },
            "SentencePiece-style",
        ),
    ],
)
def test_a_tokenizer_llama_cpp_would_split_otherwise_is_refused_before_any_weight(
    edit, match, tmp_path, tokenizers_dir
):
    """tokenizer.json edited, model.safetensors removed: the refusal names the file and what it found."""
    hf = _hf_dir(tmp_path, "shared-tiny", "qwen2_moe", {}, tokenizers_dir / "lab")
    (hf / "model.safetensors").unlink()
    data = json.loads((hf / "tokenizer.json").read_text())
    data.update(edit)
    (hf / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(GGUFExportError, match=match) as err:
        export_gguf(hf, tmp_path / "model.gguf")
    assert "tokenizer.json" in str(err.value)
    assert not list(tmp_path.glob("*.gguf"))


@pytest.mark.slow
def test_llama_cpp_tokenizes_as_hugging_face(tmp_path, tokenizers_dir):
    """llama.cpp itself, with each name it has: the ids of tricky text (contractions, digit runs, CJK, runs of
    spaces, newlines, punctuation, case changes) equal the Hugging Face tokenizer's. Each tokenizer is carried by
    a checkpoint of an architecture that build loads (the pre-tokenizer does not depend on it)."""
    from tests.llama_cpp_engine import install, tokenize

    site = install()
    # a checkpoint of an architecture that build loads; OLMoE's own, where the name depends on it ("olmo")
    base = {
        arch: _hf_dir(tmp_path / arch, preset, arch, overrides, tokenizers_dir / "lab")
        for arch, preset, overrides in [
            ("qwen2_moe", "shared-tiny", {}),
            ("olmoe", "olmoe-tiny", FAMILIES["olmoe"][2]),
        ]
    }
    checked = []
    for case, (_, arch, _, _, _, _, name) in FAMILIES.items():
        if name not in ENGINE_NAMES:
            continue
        hf = base["olmoe" if arch == "olmoe" else "qwen2_moe"]
        for f in (tokenizers_dir / case).iterdir():
            shutil.copy2(f, hf / f.name)
        path = tmp_path / f"{case}.gguf"
        export_gguf(hf, path)
        assert _field(gguf.GGUFReader(path), "tokenizer.ggml.pre") == name
        tok = PreTrainedTokenizerFast.from_pretrained(hf)
        ours = [tok(text, add_special_tokens=False)["input_ids"] for text in TRICKY]
        engine = tokenize(path, TRICKY, site)
        for text, a, b in zip(TRICKY, engine, ours, strict=True):
            assert a == b, f"{case} ({name}): {text!r}"
        checked.append(name)
    assert set(checked) == set(ENGINE_NAMES)
