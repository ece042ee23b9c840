"""Suffix decoding (vLLM's `suffix` method), for agent loops that say the same things again: propose what most
often followed the sequence's latest tokens, counted over its own tokens and over the outputs of recent requests.

Counts live in tries of contexts read backwards from the token that followed them, so that the longest context
ending a sequence is one walk from the root, and counting a new token is one walk too. A context seen once is a
leaf that remembers where it was seen and matches longer contexts against those tokens: the tries grow with how
much text repeats, not with text times depth."""

from tiffin.engine.core.sequence import Sequence
from tiffin.engine.speculative_config import SpeculativeConfig


class _Node:
    """A context: how often a token followed it (`total`), which one most often (`best`; on a tie, the first to get
    there) and how often each did (`counts`, None while only `best` did). Its longer contexts are `older`, keyed by
    the token before it; a leaf seen once keeps `source[at]`, the token that followed it, to match them against."""

    __slots__ = ("total", "best", "counts", "older", "source", "at")

    def __init__(self, best: int, source: list[int] | None = None, at: int = 0):
        self.total, self.best, self.counts = 1, best, None
        self.older: dict[int, _Node] | None = None
        self.source, self.at = source, at

    @property
    def probability(self) -> float:
        return (self.total if self.counts is None else self.counts[self.best]) / self.total

    def count(self, token: int) -> None:
        self.total += 1
        if self.counts is None and token != self.best:
            self.counts = {self.best: self.total - 1}
        if self.counts is not None:
            n = self.counts[token] = self.counts.get(token, 0) + 1
            if n > self.counts[self.best]:
                self.best = token

    def uncount(self, token: int) -> None:
        self.total -= 1
        if self.counts is not None:
            n = self.counts[token] = self.counts[token] - 1
            if not n:
                del self.counts[token]
            if token == self.best and 2 * n < self.total:  # else it still has no fewer than any other
                self.best = max(self.counts, key=self.counts.__getitem__)


class ContextTrie:
    """How often each token followed each context of up to `depth` tokens, in the token lists added to it."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node(-1)  # the empty context: never counted, never proposes
        self.root.total, self.root.older = 0, {}

    def add(self, tokens: list[int], start: int = 0) -> None:
        """Count what followed each context in `tokens`, for the tokens from `start` on (those before are counted
        already). Leaves keep `tokens`, which must only grow from here on."""
        for i in range(max(start, 1), len(tokens)):
            node = self.root
            for d in range(min(i, self.depth)):  # `node`: the d tokens before i
                older = tokens[i - 1 - d]
                child = node.older.get(older)
                if child is None:
                    node.older[older] = self._leaf(tokens, i, d + 1)
                    break
                if child.source is not None:
                    self._split(child, d + 1)
                child.count(tokens[i])
                node = child

    def remove(self, tokens: list[int]) -> None:
        """Uncount `tokens`, added whole before; contexts no longer seen go."""
        for i in range(1, len(tokens)):
            node = self.root
            for d in range(min(i, self.depth)):
                older = tokens[i - 1 - d]
                child = node.older[older]
                if child.total == 1:  # all its longer contexts were this occurrence too
                    del node.older[older]
                    break
                child.uncount(tokens[i])
                node = child

    def match(self, context: list[int]) -> tuple[int, _Node]:
        """The longest context (up to `depth` tokens) that ends `context` and was followed by a token: its length
        and node (0 and the root when none was)."""
        node, d, limit = self.root, 0, min(len(context), self.depth)
        while d < limit:
            if node.source is not None:  # seen once: the longer contexts are those tokens
                source, at = node.source, node.at
                while d < limit and d < at and source[at - 1 - d] == context[-1 - d]:
                    d += 1
                break
            child = node.older.get(context[-1 - d])
            if child is None:
                break
            node, d = child, d + 1
        return d, node

    def _leaf(self, tokens: list[int], i: int, depth: int) -> _Node:
        """The `depth` tokens before tokens[i], a context seen once: it keeps `tokens` to match longer ones, if any."""
        return _Node(tokens[i], tokens if depth < self.depth else None, i)

    def _split(self, leaf: _Node, depth: int) -> None:
        """Make `leaf` an inner node before a second occurrence is counted: its one occurrence moves to a child."""
        source, at = leaf.source, leaf.at
        leaf.older, leaf.source = {}, None
        if at > depth:  # a token comes before its context
            leaf.older[source[at - 1 - depth]] = self._leaf(source, at, depth + 1)


class SuffixProposer:
    """Proposes, token by token, what most often followed the longest context (up to
    `suffix_decoding_max_tree_depth` tokens) that ends the sequence and its proposals so far, as long as that
    token followed the context at least `suffix_decoding_min_token_prob` of the time, and no more tokens than
    `suffix_decoding_max_spec_factor` times the first context's length (a short match says little of what comes
    next, and a rejected proposal costs a verifying row).

    Contexts are looked up in the sequence's own tokens (prompt and outputs) and in the outputs of the latest
    `suffix_decoding_max_cached_requests` finished requests, apart: the longer match wins, the sequence's own on
    a tie (its own text says more about what it does next than other requests'), and the counts are not summed.
    A sequence's own counts grow with each new token; its outputs join the cache, and its own counts go, at the
    first call that finds it finished. Preempted sequences keep their counts until they are back."""

    def __init__(self, config: SpeculativeConfig):
        self.k, self.min_prob = config.num_speculative_tokens, config.suffix_decoding_min_token_prob
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.depth, self.max_cached = config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests
        self.cache = ContextTrie(self.depth)  # the outputs in `cached`
        self.cached: dict[str, list[list[int]]] = {}  # request id -> its finished sequences' outputs; oldest first
        self.own: dict[int, tuple[Sequence, ContextTrie, int]] = {}  # seq id -> (seq, its trie, tokens counted)

    def propose(self, seqs: list[Sequence]) -> None:
        self._retire({seq.seq_id for seq in seqs})
        for seq in seqs:
            _, trie, counted = self.own.get(seq.seq_id) or (seq, ContextTrie(self.depth), 0)
            trie.add(seq.token_ids, counted)
            self.own[seq.seq_id] = seq, trie, seq.num_tokens
            seq.spec_token_ids = self._walk(trie, seq.token_ids)

    def _retire(self, live: set[int]) -> None:
        for seq_id in self.own.keys() - live:
            seq = self.own[seq_id][0]
            if seq.finished:
                del self.own[seq_id]
                self._learn(seq.request_id, seq.output_token_ids)

    def _learn(self, request_id: str, output: list[int]) -> None:
        """Cache `output`, its request now the newest; forget the oldest request past the limit."""
        self.cached[request_id] = [*self.cached.pop(request_id, []), output]
        self.cache.add(output)
        if len(self.cached) > self.max_cached:
            for tokens in self.cached.pop(next(iter(self.cached))):
                self.cache.remove(tokens)

    def _walk(self, own: ContextTrie, tokens: list[int]) -> list[int]:
        context, proposal, limit = tokens[-self.depth :], [], self.k
        while len(proposal) < limit:
            (depth, node), (cached_depth, cached) = own.match(context), self.cache.match(context)
            if cached_depth > depth:
                depth, node = cached_depth, cached
            if not depth or node.probability < self.min_prob:
                break
            if not proposal:
                limit = min(self.k, max(1, int(self.spec_factor * depth)))
            proposal.append(node.best)
            context.append(node.best)
        return proposal
