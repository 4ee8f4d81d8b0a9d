"""One decode step's ops under torch.compile(fullgraph=True): no graph break, so no host synchronisation in any
wrapper or op, and the fake implementations agree with the real ones (aot_eager runs both)."""

import torch

import dspark_kernels as dk


def test_decode_step_compiles_without_graph_breaks():
    torch.manual_seed(0)
    n, k, vocab, rank, d = 3, 4, 17, 5, 6
    head = dk.MarkovHead("rnn", torch.randn(vocab, rank), torch.randn(vocab, rank),
                         wj=torch.randn(3 * rank, 2 * rank + d), bj=torch.randn(3 * rank))
    conf = dk.ConfidenceHead(torch.randn(d + rank), 0.1)
    table = dk.CostTable([1, 8, 32], [1.0, 1.2, 2.0])
    block_table = torch.arange(n * 8, dtype=torch.int32).view(n, 8)

    def step(base, anchors, hidden, target_rows, seq_lens, seed, offset):
        draft = dk.draft_block(base, anchors, head, hidden=hidden, confidence=conf, temperature=0.8, seed=seed,
                               offset=offset, return_logits=True)
        sched = dk.schedule_verify_lens(draft.survival, cost_table=table, mode="exact")
        res = dk.verify_chain(target_rows, draft.tokens, verify_lens=sched.verify_lens, draft_logits=draft.logits,
                              temperature=0.8, seed=seed, offset=offset, method="block")
        scan = dk.accept_prefix_scan(res.tokens, seq_lens, num_accepted=res.num_accepted, block_table=block_table,
                                     block_size=4, stop_token_ids=torch.tensor([3]))
        return draft.tokens, sched.verify_lens, res.tokens, scan.out_tokens, scan.kv_slots, scan.finished

    args = (torch.randn(n, k, vocab), torch.tensor([1, 2, 3]), torch.randn(n, k, d), torch.randn(n, k + 1, vocab),
            torch.tensor([5, 9, 2], dtype=torch.int32), torch.tensor(7), torch.tensor([11]))
    eager = step(*args)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
