"""The run-time byte-level BPE tokenizer (``model.tiny.tokenizer: bpe``, issue 13) and the SFT loss
that applies the LM head only at loss positions.

The tokenizer is trained once per module through the path ``copc train`` takes: the
``configs/search/cpu_tiny.yaml`` config, a real :class:`~trainer.tasks.SearchTask` (given a
retriever URL, so no server is started: nothing here queries it until the episode test, which
uses an in-process BM25 over real corpus passages), :func:`trainer.app.context.initial_model_dir`,
then :func:`trainer.models.loading.load_tokenizer` on the written ``init_model`` (what engines
and the learner load).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from scripted import scripted
from search_server import CORPUS, QA_DIR
from transformers import AutoConfig

from environments.search.env import (
    INVALID_ACTION_REPLY,
    SearchEnv,
    format_passages,
    information_block,
    load_qa,
)
from trainer.app.context import initial_model_dir
from trainer.config import ConfigError, ExperimentConfig, load_config
from trainer.config.specs import agent_loop_config, task_spec
from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.errors import TrainingError
from trainer.logprobs import sequence_logprobs
from trainer.models.bpe import MIN_VOCAB, train_bpe_tokenizer
from trainer.models.loading import load_model_and_tokenizer, load_tokenizer
from trainer.models.tiny import SPECIAL_TOKENS, TinyModelConfig, build_tiny_model
from trainer.rollout.agent_loop import run_episode
from trainer.tasks import SearchTask, build_task
from trainer.warmstart.sft import action_token_loss

CONFIG = Path(__file__).parent.resolve().parents[2] / "configs" / "search" / "cpu_tiny.yaml"
TAGS = SearchTask.tokenizer_tags
needs_shared = pytest.mark.skipif(not CORPUS.is_file() or not (QA_DIR / "qa" / "nq.jsonl").is_file(),
                                  reason=f"data not found under {QA_DIR}")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class SearchRun:
    """What the module fixture built: the config, the started task, the texts its
    ``tokenizer_texts()`` yields, the ``init_model`` directory, its reloaded tokenizer, and the
    same tokenizer trained in memory by ``train_bpe_tokenizer`` on those texts."""

    cfg: ExperimentConfig
    task: SearchTask
    texts: list[str]
    model_dir: Path
    tok: Any
    trained: Any


@pytest.fixture(scope="module")
def search_run(tmp_path_factory):
    """The cpu_tiny search config's BPE tokenizer, trained by ``initial_model_dir`` on a real
    SearchTask's text (~18.6k strings, 4096 tokens; a few seconds) and reloaded from disk."""
    if not CORPUS.is_file() or not (QA_DIR / "qa" / "nq.jsonl").is_file():
        pytest.skip(f"data not found under {QA_DIR}")
    out = tmp_path_factory.mktemp("search_bpe")
    cfg = load_config(CONFIG, [f"task.data_dir={QA_DIR}", "task.settings.retriever_url=http://127.0.0.1:9",
                               f"output_dir={out}"])
    with build_task(task_spec(cfg)) as task:  # a given retriever URL: no server is started
        texts = list(task.tokenizer_texts())
        model_dir = initial_model_dir(cfg, out, task)
        trained = train_bpe_tokenizer(texts, cfg.model.tiny.vocab_size, task.tokenizer_tags)
        yield SearchRun(cfg, task, texts, model_dir, load_tokenizer(model_dir), trained)


def corpus_contents() -> list[str]:
    """The ``contents`` of every corpus line, in file order."""
    with open(CORPUS, encoding="utf-8") as f:
        return [json.loads(line)["contents"] for line in f]


def one_passage_block(contents: str) -> str:
    """A passage as the search tool renders a one-hit result."""
    return information_block(format_passages([{"document": {"contents": contents}}]))


def assert_round_trips(tok, strings: list[str], what: str) -> None:
    """``decode(encode(s, add_special_tokens=False)) == s`` for every string (batched; the
    batched ids are checked against single ``encode`` calls on a sample)."""
    ids = tok(strings, add_special_tokens=False)["input_ids"]
    for i in random.Random(0).sample(range(len(strings)), min(50, len(strings))):
        assert ids[i] == tok.encode(strings[i], add_special_tokens=False)
    decoded = tok.batch_decode(ids)
    bad = [s for s, d in zip(strings, decoded, strict=True) if s != d]
    assert not bad, f"{len(bad)} of {len(strings)} {what} do not round-trip, e.g. {bad[0]!r}"


# -- 1. lossless on the whole corpus and every question -------------------------------------------

@needs_shared
def test_round_trips_every_corpus_passage_and_rendered_block(search_run):
    tok, contents = search_run.tok, corpus_contents()
    with open(CORPUS, encoding="utf-8") as f:
        assert len(contents) == sum(1 for _ in f) == 17939
    assert_round_trips(tok, contents, "passages")
    blocks = [one_passage_block(c) for c in contents]
    assert_round_trips(tok, blocks, "<information> blocks")
    # on real observations each tag is one token, once per block
    open_id, close_id = (tok.convert_tokens_to_ids(t) for t in ("<information>", "</information>"))
    ids = tok(blocks[:2000], add_special_tokens=False)["input_ids"]
    assert all(x.count(open_id) == 1 and x.count(close_id) == 1 for x in ids)
    # and the point of it: several bytes per token (the byte tokenizer: exactly 1)
    n_bytes = sum(len(b.encode()) for b in blocks[:2000])
    assert n_bytes / sum(map(len, ids)) > 3.0


@needs_shared
def test_round_trips_every_question_of_nq_and_hotpotqa(search_run):
    for name in ("nq", "hotpotqa"):
        questions = [r["question"] for r in load_qa(name, str(QA_DIR))]
        assert len(questions) == 500
        assert_round_trips(search_run.tok, questions, f"{name} questions")


@needs_shared
def test_tokenizer_texts_are_training_prompts_reply_and_corpus_never_held_out(search_run):
    task, texts = search_run.task, search_run.texts
    train, held = task.train_samples, task.eval_samples
    assert (len(train), len(held)) == (2191, 334)
    env = task.make_env()
    try:
        prompts = [env.reset(options={"sample": dict(r)})[0] for r in train]
        held_prompts = {env.reset(options={"sample": dict(r)})[0] for r in held}
    finally:
        env.close()
    n = len(train)
    assert texts[:n] == prompts
    assert all(f"Question: {r['question'].strip()}" in p for r, p in zip(train, prompts, strict=True))
    assert texts[n] == INVALID_ACTION_REPLY
    assert texts[n + 1:] == [one_passage_block(c) for c in corpus_contents()]
    assert not held_prompts & set(texts)
    assert len(texts) == n + 1 + 17939


@needs_shared
def test_initial_model_dir_trained_on_the_task_texts_and_tags(search_run):
    # BPE training is deterministic: the same texts and tags give the same vocabulary and merges
    assert search_run.tok.get_vocab() == search_run.trained.get_vocab()
    some = search_run.texts[::500]
    assert search_run.tok(some)["input_ids"] == search_run.trained(some)["input_ids"]
    assert type(search_run.tok).__name__ != "Qwen2Tokenizer"  # tokenizer.json verbatim (no NFC)


@needs_shared
def test_tokenizer_texts_never_read_held_out_rows(search_run):
    class Untouchable(list):
        def _read(self, *a):
            raise AssertionError("tokenizer_texts read the held-out rows")
        __iter__ = __getitem__ = __len__ = __bool__ = _read

    task = search_run.task
    saved, task.eval_samples = task.eval_samples, Untouchable()
    try:
        first = next(iter(task.tokenizer_texts()))
        assert first == search_run.texts[0]
        assert sum(1 for _ in task.tokenizer_texts()) == len(search_run.texts)
    finally:
        task.eval_samples = saved


# -- 2. tags, special tokens, vocabulary, Unicode, errors -----------------------------------------

@needs_shared
@pytest.mark.parametrize("tag", TAGS)
def test_each_tag_is_one_token_alone_and_inside_text(search_run, tag):
    tok = search_run.tok
    ids = tok.encode(tag, add_special_tokens=False)
    assert len(ids) == 1 and tok.decode(ids) == tag
    tag_id = ids[0]
    assert tok.convert_ids_to_tokens(tag_id) == tag
    for text in (f"x{tag}who{tag}y", f"Question: who?\n{tag} query {tag}\n\n", f"é🙂{tag}{tag}漢字"):
        got = tok.encode(text, add_special_tokens=False)
        assert got.count(tag_id) == 2, text
        assert tok.decode(got) == text
        # a tag is not special: skipping special tokens keeps it (and drops EOS)
        assert tok.decode([*got, tok.eos_token_id], skip_special_tokens=True) == text


@needs_shared
def test_search_call_spells_with_the_tag_ids(search_run):
    tok = search_run.tok
    ids = tok.encode("x<search>who</search>", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<search>") in ids and tok.convert_tokens_to_ids("</search>") in ids
    assert ids[-1] == tok.convert_tokens_to_ids("</search>")


@needs_shared
def test_special_tokens_and_vocabulary_size(search_run):
    tok, vocab = search_run.tok, search_run.cfg.model.tiny.vocab_size
    assert vocab == 4096 and len(tok) == vocab
    assert AutoConfig.from_pretrained(search_run.model_dir).vocab_size == vocab
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == (*SPECIAL_TOKENS, None)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert eos != pad and {eos, pad} <= set(range(vocab))
    tag_ids = {tok.convert_tokens_to_ids(t) for t in TAGS}
    assert len(tag_ids) == len(TAGS) and not tag_ids & {eos, pad, tok.unk_token_id}
    assert tok.decode([eos]) == SPECIAL_TOKENS[0] and tok.decode([eos], skip_special_tokens=True) == ""
    assert tok.encode("ab", add_special_tokens=True) == tok.encode("ab", add_special_tokens=False)  # no BOS


UNUSUAL = [
    "🙂👍🏽 👨‍👩‍👧 🇫🇷",              # emoji, skin tone, ZWJ family, flag
    "a\x00b\x00",                     # NUL
    "\u0301", "\u0301\u0302x\u0308",  # lone combining marks
    "漢字かなカナ한국어",               # CJK
    "שלום مرحبا \u200f\u200b\ufeff",  # RTL, direction mark, zero width, BOM
    "  lead\r\n\ttabs  trailing  \n\n",
    "<|endoftext|> as text",          # the EOS string in text
    "Ġ ĉ Ċ \x7f \x1b[0m",             # byte-map look-alikes, DEL, escape codes
    "\U0010ffff\U0001f9ea",
]


@needs_shared
@pytest.mark.parametrize("text", [*UNUSUAL, "e\u0301 x\u0308 \u212b \ufb01"])  # not NFC: kept as is
def test_unusual_unicode_round_trips(search_run, text):
    tok = search_run.tok
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert ids == search_run.trained.encode(text, add_special_tokens=False)  # reloading changes nothing
    tagged = f"<answer>{text}</answer>"
    assert tok.decode(tok.encode(tagged, add_special_tokens=False)) == tagged


@pytest.mark.parametrize(("vocab_size", "tags", "needle"), [
    (MIN_VOCAB - 1, (), "vocab_size=511"),
    (0, (), "vocab_size=0"),
    (True, (), "vocab_size=True"),
    (4096.0, (), "vocab_size=4096.0"),
    ("4096", (), "vocab_size='4096'"),
    (MIN_VOCAB, ("<a>", "<a>"), "tags=['<a>', '<a>']"),
    (MIN_VOCAB, ("<a>", ""), "tags=['<a>', '']"),
    (MIN_VOCAB, ("<|pad|>",), "tags=['<|pad|>']"),
    (MIN_VOCAB, ("<ok>", "<é>"), "tags=['<é>']"),   # 'é' is a byte of the byte-level alphabet
])
def test_bad_arguments_raise_value_error_naming_them(vocab_size, tags, needle):
    with pytest.raises(ValueError) as ei:
        train_bpe_tokenizer(["some text"], vocab_size, tags)
    assert needle in str(ei.value)


@pytest.mark.parametrize(("override", "needle"), [
    ("model.tiny.tokenizer=wordpiece", "model.tiny.tokenizer='wordpiece'"),
    ("model.tiny.vocab_size=100", "model.tiny.vocab_size=100"),
    ("model.tiny.vocab_size=511", "model.tiny.vocab_size=511"),
    ("model.tiny.vocab_size=many", "model.tiny.vocab_size"),
])
def test_config_errors_name_the_key(override, needle):
    with pytest.raises(ConfigError) as ei:
        load_config(CONFIG, [override])
    assert needle in str(ei.value)


def test_small_text_gives_at_most_the_requested_vocabulary_and_non_ascii_tags():
    texts = ["hello world, hello there"] * 20
    tok = train_bpe_tokenizer(texts, MIN_VOCAB, ("<tool call>", "\n<x>\n", "<工具>"))
    assert len(tok) < MIN_VOCAB  # the trainer stops when no pair is frequent enough
    for tag in ("<tool call>", "\n<x>\n", "<工具>"):  # spaces, newlines, non-alphabet characters: fine
        ids = tok.encode(f"a{tag}b", add_special_tokens=False)
        assert tok.convert_tokens_to_ids(tag) in ids and tok.decode(ids) == f"a{tag}b"


# -- 3. engine / learner log-prob parity on a search episode -------------------------------------

class CorpusBM25:
    """The search env's retriever interface over an in-process bm25s index of real passages."""

    def __init__(self, passages: list[str]):
        from retriever.bm25 import BM25Config, BM25Searcher

        self.passages = passages
        self.searcher = BM25Searcher.build(passages, BM25Config(), show_progress=False)

    def retrieve(self, queries, topk=None):
        rows, scores = self.searcher.search(list(queries), topk or 3)
        return [[{"document": {"id": str(i), "contents": self.passages[i]}, "score": float(s)}
                 for i, s in zip(r, sc, strict=True) if i >= 0] for r, sc in zip(rows, scores, strict=True)]


@needs_shared
def test_search_episode_engine_logprobs_equal_learner_logprobs(search_run):
    model, tok = load_model_and_tokenizer(search_run.model_dir)
    cfg = search_run.cfg
    sample = search_run.task.train_samples[0]
    question, golden = sample["question"].strip(), sample["golden_answers"][0]
    actions = [f"<think>Look it up.</think>\n<search>{question}</search>",
               f"<search>{' '.join(question.split()[-3:])}</search>",
               f"<think>Found it.</think>\n<answer>{golden}</answer>"]
    env = SearchEnv(retriever=CorpusBM25(corpus_contents()[:3000]), **cfg.task.env_kwargs)
    agent_cfg = agent_loop_config(cfg)
    temperature = 0.8

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(
            tok, actions, lambda prompt: prompt.count("</information>")), version=2)
        tr = await run_episode(eng, env, tok, sample, SamplingParams(
            temperature=temperature, max_new_tokens=cfg.rollout.max_new_tokens), agent_cfg)
        # no top-p: µ is compared with the untruncated learner log-probs below (a top-p µ is the
        # truncated one since issue 46 item 1: tests/trainer/learner/test_sampling_support.py)
        await eng.close()
        return tr

    tr = asyncio.run(main())
    assert tr.finish_reason == "terminated" and tr.turns == 3 and tr.reward == 1.0
    mask = torch.tensor(tr.loss_mask, dtype=torch.bool)
    ids = torch.tensor(tr.response_ids)
    assert tok.decode(ids[mask].tolist(), skip_special_tokens=True) == "".join(actions)
    obs_ids = ids[~mask].tolist()
    act_ids = ids[mask].tolist()
    tid = tok.convert_tokens_to_ids
    assert obs_ids.count(tid("<information>")) == obs_ids.count(tid("</information>")) == 2
    assert act_ids.count(tid("<search>")) == act_ids.count(tid("</search>")) == 2
    assert act_ids.count(tid("<answer>")) == 1 and act_ids[-1] == tid("</answer>")  # a stop string
    assert "Doc 1(Title:" in tok.decode(obs_ids)
    assert len(tr.prompt_ids) + len(tr.response_ids) <= agent_cfg.max_total_tokens
    # the learner's recomputation on the same token ids equals the engine's behavior log-probs µ
    full = torch.tensor([tr.prompt_ids + tr.response_ids])
    lp = sequence_logprobs(model, full, torch.ones_like(full), temperature)[0, len(tr.prompt_ids):]
    mu = torch.tensor(tr.logp_mu)
    assert (lp - mu)[mask].abs().max().item() < 1e-5
    assert mu[mask].max().item() < 0 and mu[mask].mean().item() < -1.0  # untrained: forced tokens unlikely
    assert all(v == 2 for v, m in zip(tr.versions, tr.loss_mask, strict=True) if m)


# -- 4. LM head only at loss positions -------------------------------------------------------------

def right_padded(lengths: list[int], vocab: int, pad_id: int, seed: int = 0):
    """Random ``(ids, attn, loss_mask)`` ``(B, L)`` int64 batches, right padded, loss on a few spans."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.full((len(lengths), L), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    lm = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(0, vocab - 2, (n,), generator=g)
        attn[b, :n] = 1
        lm[b, n // 3: n // 2] = 1           # an action
        lm[b, 2 * n // 3: n - 2] = 1        # a later action; the last 2 tokens are observation
    return ids, attn, lm


def slow_action_loss(model, ids, attn, lm) -> torch.Tensor:
    """Reference: full logits, cross-entropy of each loss token from the previous position, mean."""
    logits = model(input_ids=ids, attention_mask=attn).logits.double()
    terms = [-torch.log_softmax(logits[b, i - 1], -1)[ids[b, i]]
             for b in range(ids.shape[0]) for i in range(1, ids.shape[1]) if lm[b, i]]
    return torch.stack(terms).mean()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_action_token_loss_equals_slow_reference_and_ignores_trailing_garbage(arch):
    vocab = 300
    model = build_tiny_model(TinyModelConfig(arch=arch, hidden_size=32, intermediate_size=64, seed=2),
                             vocab, vocab - 2, vocab - 1)
    ids, attn, lm = right_padded([40, 23, 31], vocab, vocab - 1, seed=3)
    loss = action_token_loss(model, ids, attn, lm)
    with torch.no_grad():
        ref = slow_action_loss(model, ids, attn, lm)
    assert loss.dtype == torch.float32 and loss.requires_grad
    assert abs(loss.item() - ref.item()) < 1e-6
    # garbage after each row's last loss token (observation and padding, attended or not) changes nothing
    junk_ids, junk_attn = ids.clone(), attn.clone()
    g = torch.Generator().manual_seed(9)
    for b in range(ids.shape[0]):
        last = int(lm[b].nonzero().max())
        junk_ids[b, last + 1:] = torch.randint(0, vocab, (ids.shape[1] - last - 1,), generator=g)
        junk_attn[b, last + 1:] = 1
    assert not torch.equal(junk_ids, ids)
    with torch.no_grad():
        assert abs(action_token_loss(model, junk_ids, junk_attn, lm).item() - loss.item()) < 1e-6
        assert abs(action_token_loss(model, junk_ids, attn, lm).item() - loss.item()) < 1e-6
    # and the loss does see the tokens it scores
    flipped = ids.clone()
    flipped[0, int(lm[0].nonzero().max())] = (ids[0, int(lm[0].nonzero().max())] + 1) % (vocab - 2)
    with torch.no_grad():
        assert abs(action_token_loss(model, flipped, attn, lm).item() - loss.item()) > 1e-4


# -- 5. initial_model_dir -----------------------------------------------------------------------------

class TextTask:
    """The two things ``initial_model_dir`` asks of a task, over fixed text (counts its reads)."""

    tokenizer_tags = ("<search>", "</search>", "<answer>", "</answer>")

    def __init__(self, texts: list[str]):
        self._texts, self.reads = texts, 0

    def tokenizer_texts(self):
        self.reads += 1
        yield from self._texts


def tiny_bpe_cfg(*extra: str) -> ExperimentConfig:
    return load_config(None, ["model.tiny.tokenizer=bpe", "model.tiny.vocab_size=600",
                              "model.tiny.arch=llama", "model.tiny.hidden_size=32",
                              "model.tiny.intermediate_size=64", *extra])


def test_initial_model_dir_bpe_writes_a_model_whose_vocabulary_is_the_tokenizer(tmp_path):
    texts = [f"Question {i}: who wrote book number {i * 7}? <search>book {i}</search> <answer>A{i}</answer>"
             for i in range(300)]
    task = TextTask(texts)
    d = initial_model_dir(tiny_bpe_cfg(), tmp_path, task)
    assert d == tmp_path / "init_model" and task.reads == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["init_model"]  # no temporary left
    model, tok = load_model_and_tokenizer(d)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 32
    assert len(tok) == model.config.vocab_size == model.get_input_embeddings().num_embeddings <= 600
    assert len(tok) > 262  # merges were learned (256 bytes + 2 special + 4 tags is 262)
    assert len(tok.encode(" wrote", add_special_tokens=False)) == 1
    for tag in TextTask.tokenizer_tags:
        assert len(tok.encode(tag, add_special_tokens=False)) == 1
    assert (model.config.eos_token_id, model.config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert tok.decode(tok.encode(texts[5], add_special_tokens=False)) == texts[5]
    # an existing init_model is reused: no retraining
    assert initial_model_dir(tiny_bpe_cfg(), tmp_path, task) == d and task.reads == 1


def test_initial_model_dir_bpe_without_a_task_and_the_byte_default(tmp_path):
    with pytest.raises(TrainingError, match=r"model\.tiny\.tokenizer='bpe'"):
        initial_model_dir(tiny_bpe_cfg(), tmp_path / "a", None)
    task = TextTask(["unused"])
    d = initial_model_dir(tiny_bpe_cfg("model.tiny.tokenizer=byte"), tmp_path / "b", task)
    assert task.reads == 0 and len(load_tokenizer(d)) == 258 == AutoConfig.from_pretrained(d).vocab_size
