"""Generation: token-by-token decoding equals scoring segment by segment for every memory kind,
and the samplers draw from the distribution they promise."""

import io
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memjax.generation import text as generation_text
from memjax.data.tokenizers import ByteTokenizer, WordTokenizer
from memjax.generation import Sampling, sample
from memjax.generation import sampling as sampling_lib
from memjax.model import lm
from memjax.model import memories
from memjax.model.config import ModelConfig
from memjax.training import loop as trainer
from memjax.training import experiment
from memjax.training import restore
from memjax.training import saved_run
from memjax.training.step import stream_keys
import toy_memory  # noqa: F401  (registers 'every_other', a kind memjax does not know)
import training_fixtures

SEG, VOCAB = 4, 30
# A large init makes the outputs depend strongly on every key, so a key seen at the wrong
# distance or a missing one changes the log-probs far beyond the tolerance.
BASE = dict(vocab_size=VOCAB, d_model=16, n_layer=2, n_head=2, d_head=8, d_inner=32, dropout=0.0,
            segment_len=SEG, init_std=0.2)
INFINITY = dict(memory='infinity', block='gpt2', positions='learned_absolute', pre_lnorm=True, n_positions=SEG,
                ltm_basis=16, ltm_widths=(0.05, 0.1), ltm_tau=0.5)
KINDS = {
    'none': dict(memory='none', mem_len=0),
    'xl': dict(memory='xl', mem_len=6),
    'xl_same_length_scanned': dict(memory='xl', mem_len=6, same_length=True, scan_layers=True),
    'xl_adaptive_softmax': dict(memory='xl', mem_len=5, cutoffs=(10, 20), div_val=2),
    'xl_cached': dict(memory='xl_cached', mem_len=6),
    'lamemo': dict(memory='lamemo', mem_len=6),
    'lamemo_memory_shorter_than_segment': dict(memory='lamemo', mem_len=3),
    'trams': dict(memory='trams', mem_len=8, trams_select=5, trams_remain=2),
    'infinity': dict(INFINITY, mem_len=0),
    'infinity_sticky_with_memory': dict(INFINITY, mem_len=4, ltm_sticky=True),
    # A kind from outside memjax (tests/toy_memory.py): explicit distances, random streams.
    'every_other_test_kind': dict(memory='every_other', mem_len=6),
}
PROMPT_LEN, NEW = 6, 13  # The prompt ends inside a segment; generation crosses four boundaries.


def test_every_kind_is_covered():
    assert {c['memory'] for c in KINDS.values()} == set(memories.names())


def scored_segment_by_segment(model, params, text, seed):
    """log p(text[t + 1] | text[:t + 1]) [B, n - 1] from the whole segments, as evaluation scores
    them (the last one padded: causality hides the padding), the kind's streams drawn per segment
    as generation draws them."""
    batch, n = text.shape
    padded = np.zeros((batch, -(-n // SEG) * SEG + 1), np.int32)
    padded[:, :n] = text
    streams_key = jax.random.split(jax.random.key(seed))[0]
    # One program for every segment: op by op, the model's ops would each compile.
    score = jax.jit(lambda params, inputs, memory, targets, key: model.apply(
        {'params': params}, inputs, memory, targets=targets, rngs=stream_keys(key, model.kind, 0)))
    memory, scores = lm.init_memory(model.config, batch), []
    for s in range((padded.shape[1] - 1) // SEG):
        out, memory = score(params, padded[:, s * SEG:(s + 1) * SEG], memory, padded[:, s * SEG + 1:(s + 1) * SEG + 1],
                            jax.random.fold_in(streams_key, s))
        scores.append(np.asarray(out.target_logprobs))
    return np.concatenate(scores, axis=1)[:, :n - 1]


@pytest.mark.parametrize('kind', sorted(KINDS))
def test_generated_logprobs_equal_scoring_segment_by_segment(kind):
    cfg = ModelConfig(**BASE, **KINDS[kind])
    model, params = lm.build_model(cfg), lm.init_params(cfg, jax.random.key(1))
    prompt = np.random.default_rng(0).integers(0, VOCAB, (2, PROMPT_LEN))
    out = sample(model, params, prompt, NEW, Sampling(), seed=5)
    scored = scored_segment_by_segment(model, params, np.concatenate([prompt, out.tokens], axis=1), seed=5)
    np.testing.assert_allclose(out.logprobs, scored[:, PROMPT_LEN - 1:], atol=1e-5, rtol=0)


def test_greedy_is_the_argmax_of_one_pass_scores_and_a_seed_reproduces():
    cfg = ModelConfig(**BASE, **KINDS['xl'])
    model, params = lm.build_model(cfg), lm.init_params(cfg, jax.random.key(2))
    prompt = np.random.default_rng(1).integers(0, VOCAB, (3, 5))
    greedy = sample(model, params, prompt, 10, Sampling(temperature=0))
    best = scored_best(model, params, np.concatenate([prompt, greedy.tokens], axis=1))
    np.testing.assert_array_equal(greedy.tokens, best[:, 4:])
    draws = [sample(model, params, prompt, 10, Sampling(top_p=0.9), seed=seed).tokens for seed in (3, 3, 4)]
    np.testing.assert_array_equal(draws[0], draws[1])
    assert (draws[0] != draws[2]).any()


def scored_best(model, params, text):
    """The most probable next token after each position, from the whole segments."""
    batch, n = text.shape
    padded = np.zeros((batch, -(-n // SEG) * SEG), np.int32)
    padded[:, :n] = text
    @jax.jit
    def best_next(params, inputs, memory):
        out, memory = model.apply({'params': params}, inputs, memory)
        return model.apply({'params': params}, out.hidden, method=model.logprobs).argmax(-1), memory

    memory, best = lm.init_memory(model.config, batch), []
    for s in range(padded.shape[1] // SEG):
        tokens, memory = best_next(params, padded[:, s * SEG:(s + 1) * SEG], memory)
        best.append(np.asarray(tokens))
    return np.concatenate(best, axis=1)[:, :n - 1]


# A known distribution over 12 tokens in three adaptive-softmax clusters (4 head tokens, then two
# tail clusters of 4), the most probable token in the last cluster.
KNOWN = np.log(np.array([0.13, 0.02, 0.09, 0.05, 0.07, 0.01, 0.11, 0.03, 0.22, 0.04, 0.15, 0.08]))
CUTOFFS = (4, 8)


def known_scores(adaptive: bool, known: np.ndarray = KNOWN):
    """(config, cluster_logprobs) of the `known` log-probs, with or without clusters."""
    cfg = ModelConfig(**{**BASE, 'vocab_size': len(known), 'cutoffs': CUTOFFS if adaptive else ()})
    bounds = cfg.cluster_bounds

    def cluster_logprobs(hidden, i):
        rows = hidden.shape[0]
        if not adaptive:
            return jnp.broadcast_to(known, (rows, len(known)))
        if i == 0:
            tails = [jax.nn.logsumexp(known[bounds[c]:bounds[c + 1]]) for c in range(1, len(bounds) - 1)]
            head = jnp.concatenate([known[:bounds[1]], jnp.stack(tails)])
        else:
            part = known[bounds[i]:bounds[i + 1]]
            head = part - jax.nn.logsumexp(part)
        return jnp.broadcast_to(head, (rows, head.shape[0]))

    return cfg, cluster_logprobs


def naive_distribution(settings: Sampling, known: np.ndarray = KNOWN) -> np.ndarray:
    """The warped distribution written out: temperature, top-k, then the nucleus, each keeping the
    tokens tied with the last one it keeps."""
    x = known / settings.temperature
    keep = np.ones(len(x), bool)
    if settings.top_k:
        keep &= x >= np.sort(x)[::-1][settings.top_k - 1]
    p = np.where(keep, np.exp(x - x.max()), 0)
    p /= p.sum()
    if settings.top_p < 1:
        ordered = np.sort(p)[::-1]
        mass_before = np.cumsum(ordered) - ordered
        p = np.where(p >= ordered[mass_before < settings.top_p].min(), p, 0)
        p /= p.sum()
    return p


SETTINGS = [Sampling(), Sampling(temperature=0.5), Sampling(temperature=1.7), Sampling(top_k=3),
            Sampling(top_p=0.6), Sampling(top_p=0.3), Sampling(temperature=0.7, top_k=5, top_p=0.8)]


@pytest.mark.parametrize('adaptive', [False, True], ids=['softmax', 'adaptive_softmax'])
@pytest.mark.parametrize('settings', SETTINGS, ids=str)
def test_draws_follow_the_warped_distribution_and_never_leave_its_support(settings, adaptive):
    draws_follow(settings, adaptive)


def draws_follow(settings, adaptive, known=KNOWN, draws=20_000):
    """Asserts that `draws` tokens chosen from `known` follow the warped distribution."""
    cfg, scores = known_scores(adaptive, known)
    tokens, logprobs = jax.jit(lambda key: sampling_lib.choose(scores, cfg, jnp.zeros((draws, 1)), key, settings))(
        jax.random.key(0))
    tokens = np.asarray(tokens)
    np.testing.assert_allclose(logprobs, known[tokens], atol=1e-5)  # The model's own log-probs.
    expected = naive_distribution(settings, known)
    counts = np.bincount(tokens, minlength=len(known))
    assert counts[expected == 0].sum() == 0, 'a draw outside the top-k / the nucleus'
    seen = expected > 0
    chi2 = float(np.sum((counts[seen] - draws * expected[seen]) ** 2 / (draws * expected[seen])))
    assert chi2 < 32.9, (counts, draws * expected)  # At most 11 degrees of freedom: p = 0.0005.


def log_normalised(probs):
    probs = np.array(probs)
    return np.log(probs / probs.sum())


# Where an adaptive softmax may skip clusters: the cut falls past a cluster less likely than a head
# token; k is above the head's size; head tokens tied at the cut (in the plain path's terms).
EDGES = {
    'a_nucleus_past_an_unlikely_cluster': (log_normalised([.62, .11, .10, .09] + [.02] * 4 + [1e-6] * 4),
                                           Sampling(top_p=0.65)),
    'top_k_above_the_heads_size': (log_normalised([.2] * 4 + [.02] * 4 + [.03] * 4), Sampling(top_k=6)),
    'ties_at_the_k_th_token': (log_normalised([.3, .1, .1, .1] + [.05] * 8), Sampling(top_k=3)),
    'ties_at_the_nucleus_edge': (log_normalised([.6, .1, .1, .1] + [.02] * 4 + [.005] * 4), Sampling(top_p=0.65)),
}


@pytest.mark.parametrize('adaptive', [False, True], ids=['softmax', 'adaptive_softmax'])
@pytest.mark.parametrize('edge', sorted(EDGES))
def test_draws_follow_the_warped_distribution_where_clusters_may_be_left_out(edge, adaptive):
    known, settings = EDGES[edge]
    draws_follow(settings, adaptive, known)


@pytest.mark.parametrize('adaptive', [False, True], ids=['softmax', 'adaptive_softmax'])
def test_greedy_takes_the_most_probable_token_even_in_a_tail_cluster(adaptive):
    cfg, scores = known_scores(adaptive)
    tokens, _ = sampling_lib.choose(scores, cfg, jnp.zeros((2, 1)), jax.random.key(0), Sampling(temperature=0))
    assert np.asarray(tokens).tolist() == [int(KNOWN.argmax())] * 2


def test_a_tail_cluster_is_scored_only_when_it_can_hold_a_candidate():
    """The adaptive softmax's point at a large vocabulary: a tail cluster's logits are computed
    only when the draw needs them (counted where they run, inside the compiled branch)."""
    head_heavy = np.log(np.array([0.40, 0.05, 0.05, 0.05, 0.02, 0.03, 0.03, 0.02, 0.10, 0.10, 0.10, 0.05]))
    cfg, scores = known_scores(True, head_heavy)
    computed = []

    def counting(hidden, i):
        jax.debug.callback(lambda: computed.append(i))
        return scores(hidden, i)

    def clusters_computed(settings, rows=1, seed=0):
        computed.clear()
        tokens, _ = jax.jit(lambda key: sampling_lib.choose(counting, cfg, jnp.zeros((rows, 1)), key, settings))(
            jax.random.key(seed))
        jax.effects_barrier()
        return sorted(set(computed)), np.asarray(tokens)

    assert clusters_computed(Sampling(temperature=0))[0] == [0]  # 0.40 beats either cluster's total.
    assert clusters_computed(Sampling(top_k=3))[0] == [0, 1, 2]  # Both totals beat the 3rd best head token.
    for seed in range(6):  # Plain sampling: the head, and the cluster drawn if any.
        computed_now, tokens = clusters_computed(Sampling(), seed=seed)
        assert computed_now == [0] + [c for c in (1, 2) if CUTOFFS[c - 1] <= tokens[0] < (CUTOFFS + (12,))[c]]


def test_prompts_out_of_the_vocabulary_or_empty_are_one_line_errors():
    cfg = ModelConfig(**BASE, **KINDS['xl'])
    model, params = lm.build_model(cfg), lm.init_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match=r'outside the vocabulary \[0, 30\)'):
        sample(model, params, np.array([[1, 30]]), 2)
    with pytest.raises(ValueError, match='empty'):
        sample(model, params, np.zeros((1, 0), np.int32), 2)
    with pytest.raises(ValueError, match='top_p'):
        sample(model, params, np.array([[1]]), 2, Sampling(top_p=0))


def test_prompt_tokens_outside_the_vocabulary_are_told(caplog):
    words = WordTokenizer(['<eos>', '<unk>', 'in', 'the', 'beginning'])
    with caplog.at_level(logging.WARNING):
        generation_text.prompt_ids(words, 'in the <unk> beginning')  # Written as the unknown token.
        assert not caplog.text
        generation_text.prompt_ids(words, 'in zebra the <unk> okapi')
    assert "2 of the prompt's 5 tokens are not in the run's vocabulary" in caplog.text


def test_word_prompts_stop_mid_line_and_text_streams_whole_characters():
    words = WordTokenizer(['<eos>', '<unk>', 'in', 'the', 'beginning'])
    assert words.decode(generation_text.prompt_ids(words, 'in the')) == 'in the'
    assert words.decode(generation_text.prompt_ids(words, 'in the\n')) == 'in the\n'
    out = io.StringIO()
    stream = generation_text.TextStream(ByteTokenizer(), out)
    shown = []
    for byte in 'né à'.encode():  # Two-byte characters arrive one byte at a time.
        stream.add([byte])
        shown.append(out.getvalue())
    stream.close()
    assert '\ufffd' not in ''.join(shown) and '?' not in ''.join(shown)
    assert out.getvalue() == 'né à\n'


@pytest.mark.parametrize('tokenizer, prompt, new, expected', [
    # Words are joined by spaces: the prompt's last word and the first new one get one between them.
    (WordTokenizer(['<eos>', '<unk>', 'in', 'the', 'beginning']), 'in the', ['beginning', '<eos>', 'in'],
     ' beginning\nin'),
    (WordTokenizer(['<eos>', '<unk>', 'in', 'the', 'beginning']), 'in the ', ['beginning'], 'beginning'),
    (WordTokenizer(['<eos>', '<unk>', 'in', 'the', 'beginning']), 'in the\n', ['beginning'], 'beginning'),
    (ByteTokenizer(), 'in the ', list(b'beginning'), 'beginning'),  # Bytes are the text itself.
    (ByteTokenizer(), 'caf\u00e9', list(' au lait'.encode()), ' au lait'),
])
def test_a_continuation_reads_after_its_prompt_as_the_whole_decodes(tokenizer, prompt, new, expected):
    """What generation prints after the prompt: the prompt and its continuation decoded together,
    less the prompt (its space kept once where the tokenizer drops it), streamed or at once."""
    ids = [tokenizer.encode(t)[0] if isinstance(t, str) else t for t in new]
    prompt_ids = generation_text.prompt_ids(tokenizer, prompt)
    after = generation_text.Continuation(tokenizer, prompt_ids, prompt)
    assert after.text(ids) == expected
    if not prompt.endswith(' '):
        assert prompt + expected == tokenizer.decode(np.concatenate([prompt_ids, ids]))
    out = io.StringIO()
    stream = generation_text.TextStream(tokenizer, out, after)
    for i in ids:
        stream.add([i])
    stream.close()
    assert out.getvalue() == expected + '\n'


class _CountedFlushes(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty, self.flushes = tty, 0

    def isatty(self):
        return self.tty

    def flush(self):
        self.flushes += 1


@pytest.mark.parametrize('tty', [True, False])
def test_a_terminal_sees_each_token_and_a_notebook_a_flush_per_line(tty):
    """A notebook keeps each flush as an output of its own: one per byte made hundreds."""
    out = _CountedFlushes(tty)
    stream = generation_text.TextStream(ByteTokenizer(), out)
    text = 'def f(x):\n    return x\n'
    for byte in text.encode():
        stream.add([byte])
    stream.close()
    assert out.getvalue() == text + '\n'
    assert out.flushes == (len(text) + 1 if tty else text.count('\n') + 1)


@pytest.fixture(scope='module')
def trained_workdir(tmp_path_factory):
    corpus = training_fixtures.write_text_corpus(str(tmp_path_factory.mktemp('corpus')))
    workdir = str(tmp_path_factory.mktemp('workdir'))
    trainer.train_and_evaluate(training_fixtures.tiny_config(corpus, train__num_steps=2, train__eval_every=0),
                               workdir)
    return workdir


def test_the_command_continues_a_prompt_from_a_workdir_as_sample_does(trained_workdir):
    out = io.StringIO()
    texts = generation_text.generate(None, trained_workdir, 'In the', 12, Sampling(temperature=0), out=out)
    exp = experiment.setup(saved_run.saved_config(trained_workdir), trained_workdir, training=False)
    _, params = restore.newest_params(exp, trained_workdir)
    prompt = generation_text.prompt_ids(exp.tokenizer, 'In the')
    expected = sample(exp.eval_model, params, prompt, 12, Sampling(temperature=0)).tokens[0]
    assert texts == [exp.tokenizer.decode(expected)]
    assert out.getvalue() == texts[0] + '\n'
