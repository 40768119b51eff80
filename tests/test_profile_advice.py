"""The profile's diagnosis in words (monitoring/profiles.py: advice), from ranks with known
splits: a straggler and its cause, exposed communication with its overlap, data loading,
memory copies, an idle GPU; nothing to say about a balanced, busy job."""

from monitoring.profiles import Rank, advice, slowest_rank


def rank(number, *, dataloader=0.0, compute=0.0, memcpy=0.0, communication=0.0, idle=0.0,
         overlap=None, gpu=False):  # fmt: skip
    split = {"dataloader": dataloader, "compute": compute, "memcpy": memcpy,
             "communication": communication, "idle": idle}  # fmt: skip
    return Rank(rank=number, steps=3, split=split, step_us=sum(split.values()),
                overlap_pct=overlap, top=[], source="suanli", gpu=gpu)  # fmt: skip


def say(ranks, workers=16):
    return [(a.title, a.text) for a in advice(ranks, slowest_rank(ranks), workers=workers)]


def test_a_rank_slow_in_its_data_loading_holds_the_others_back():
    ranks = [rank(0, compute=10_000, communication=40_000),
             rank(1, dataloader=38_000, compute=10_000, communication=2_000)]  # fmt: skip
    assert slowest_rank(ranks).rank == 1
    [(title, text)] = say(ranks)
    assert title == "Rank 1 holds the others back"
    assert text.startswith("the DataLoader's __next__ takes 76 % of rank 1's step (38.0 ms of ")
    assert "the other ranks spend 80 % of theirs waiting for it in the all-reduce" in text
    assert "num_workers towards 16 (2 x the node's cores over its processes)" in text


def test_a_rank_that_computes_longer_is_the_straggler_with_its_own_advice():
    ranks = [rank(0, compute=10_000, communication=30_000),
             rank(1, compute=38_000, communication=2_000),
             rank(2, compute=11_000, communication=29_000)]  # fmt: skip
    [(title, text)] = say(ranks)
    assert title == "Rank 1 holds the others back" and "DistributedSampler" in text


def test_communication_without_a_straggler_names_the_overlap_and_the_buckets():
    ranks = [rank(0, compute=62_000, communication=38_000, overlap=12.0),
             rank(1, compute=63_000, communication=37_000, overlap=11.0)]  # fmt: skip
    [(title, text)] = say(ranks)
    assert title == "Communication"
    assert text.startswith(
        "rank 0 spends 38 % of each step waiting for the all-reduce; communication overlaps "
        "computation 12 %: try larger gradient buckets"
    )
    assert "fp16 compress hook" in text


def test_one_rank_gets_data_loading_memory_copies_and_idle_gpu_advice():
    [one] = [rank(0, dataloader=41, compute=29, memcpy=20, idle=10)]
    titles = [t for t, _ in say([one], workers=8)]
    assert titles == ["Data loading", "Memory copies"]
    assert "takes 41 % of rank 0's step" in say([one], workers=8)[0][1]
    assert "num_workers towards 8 (" in say([one], workers=8)[0][1]
    gpu = rank(0, compute=50, idle=50, gpu=True)
    [(title, text)] = say([gpu])
    assert title == "Idle GPU" and "is idle 50 % of each step" in text


def test_a_busy_balanced_job_gets_no_advice_and_no_slowest_rank():
    ranks = [rank(0, compute=95, communication=5, overlap=80.0),
             rank(1, compute=94, communication=6, overlap=80.0)]  # fmt: skip
    assert say(ranks) == [] and slowest_rank(ranks) is None
    idle = [rank(0, idle=10), rank(1, idle=10)]  # nothing but waiting: no cause to name
    assert slowest_rank(idle) is None
    assert say([rank(0, compute=80, idle=20)]) == []  # a CPU trace's idle is not a GPU's


def test_a_rank_without_a_number_reads_as_a_question_mark():
    ranks = [rank(0, compute=10_000, communication=40_000),
             rank(None, dataloader=38_000, compute=10_000, communication=2_000)]  # fmt: skip
    [(title, text)] = say(ranks)
    assert title == "Rank ? holds the others back" and "of rank ?'s step" in text
    assert "None" not in title + text
