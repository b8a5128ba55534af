"""The pipeline state machine on its own: staircase depths, fill, accept, reject, refill."""
import random

from spd.runtime.schedule import PipelineSchedule


def run(n, decisions, prompt_len=5):
    """Drive the schedule with a sequence of accept/reject decisions; return (N, K, trace)."""
    s = PipelineSchedule(n)
    s.seed(prompt_len, prompt_len)
    N = K = 0
    it = iter(decisions)
    trace = []
    while True:
        K += 1
        rows = s.draft_rows()
        assert rows.stop == s.newest + 1 and rows.start <= s.start
        s.after_draft()
        work = s.stage_work()
        # One token per stage, each stage at most once, oldest token deepest.
        stages = [st for st, _ in work]
        assert stages == sorted(stages, reverse=True) == list(range(s.count - 1, -1, -1))
        trace.append(tuple(work))
        if not s.full:
            s.refill()
            continue
        try:
            ok = next(it)
        except StopIteration:
            return N, K, trace
        N += 1
        s.accept() if ok else s.reject()


def test_all_accept_fill_limited():
    for n in (2, 3, 4, 6, 8):
        N, K, _ = run(n, [True] * 50)
        assert N == 50 and K == 50 + n  # n-1 fill cycles, 50 exits, one more (unjudged) cycle


def test_all_reject_one_token_per_n_cycles():
    for n in (2, 4, 6):
        N, K, _ = run(n, [False] * 20)
        assert N == 20 and K == 21 * n  # every exit needs a full refill first


def test_random_decisions_consistent_depths():
    rng = random.Random(0)
    for n in (2, 3, 5):
        decisions = [rng.random() < 0.6 for _ in range(200)]
        N, K, trace = run(n, decisions)
        assert N == 200 and K >= N
        # K = N + (n-1) * (number of refills) + 1 + (n - 1)
        rejects = decisions.count(False)
        assert K == N + (n - 1) * (rejects + 1) + 1


def test_depths_and_drafter_window():
    s = PipelineSchedule(3)
    s.seed(10, 10)
    assert s.depth(9) == 3 and s.depth(10) == 0
    assert list(s.draft_rows()) == [10]
    s.after_draft(); s.refill()           # 10 at depth 1, 11 at depth 0
    assert [s.depth(p) for p in s.positions] == [1, 0]
    assert list(s.draft_rows()) == [10, 11]
    s.after_draft(); s.refill()
    assert s.full and [s.depth(p) for p in s.positions] == [2, 1, 0]
    s.after_draft(); s.accept()          # 10 leaves; its row must be recomputed at depth n
    assert list(s.draft_rows()) == [10, 11, 12, 13]
    s.after_draft(); s.reject()          # correction at 12 alone in flight
    assert list(s.positions) == [12] and list(s.draft_rows()) == [11, 12]
