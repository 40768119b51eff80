"""A job's log holding PyTorch's `prof.key_averages().table()`: read into tables, shown."""

import random
import re

from django.template.loader import render_to_string
from django.utils import translation

from monitoring.keyavg import MAX_ROWS, MAX_TABLES, Cell, cell_value, parse_tables


def _printed(text):
    """torch ends every line of the table but the totals with two spaces (kept out of this
    file's literals): put them back."""
    return [line if " total: " in line else line + "  " for line in text.splitlines()]


# Printed by a 2-rank DDP job under torch 2.13 (CPU).
CPU_TABLE = _printed("""\
-------------------------------------------------------  ------------  ------------  ------------  ------------  ------------  ------------
                                                   Name    Self CPU %      Self CPU   CPU total %     CPU total  CPU time avg    # of Calls
-------------------------------------------------------  ------------  ------------  ------------  ------------  ------------  ------------
enumerate(DataLoader)#_SingleProcessDataLoaderIter._...        92.86%      81.113ms        93.17%      81.380ms      40.690ms             2
                                          ProfilerStep*         5.72%       4.999ms       100.00%      87.347ms      43.673ms             2
                        DistributedDataParallel.forward         0.26%     229.093us         0.43%     374.929us     374.929us             1
                                Optimizer.step#SGD.step         0.13%     116.623us         0.15%     131.536us     131.536us             1
                                          aten::normal_         0.10%      83.367us         0.10%      83.367us       5.210us            16
                                       c10d::allreduce_         0.09%      78.417us         0.09%      78.417us      78.417us             1
-------------------------------------------------------  ------------  ------------  ------------  ------------  ------------  ------------
Self CPU time total: 87.347ms
""")  # noqa: E501

CPU_COLUMNS = [
    "Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total", "CPU time avg", "# of Calls",
]  # fmt: skip

# As torch prints it with CUDA: "CUDA time avg" is 13 wide in a 12-wide column, so the
# header's last cells sit one place right of the dashes.
CUDA_TABLE = _printed("""\
------------------------------------------------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------
                                                  Name    Self CPU %      Self CPU   CPU total %     CPU total  CPU time avg     Self CUDA   Self CUDA %    CUDA total  CUDA time avg    # of Calls
------------------------------------------------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------
                                          aten::linear         1.20%     120.000us        40.00%       4.000ms       2.000ms       0.000us         0.00%       1.500ms     750.000us             2
autograd::engine::evaluate_function: torch::autogra...         0.50%      50.000us        10.00%       1.000ms     500.000us       0.000us         0.00%     600.000us     300.000us             2
                                  volta_sgemm_64x64_nn         0.00%       0.000us         0.00%       0.000us       0.000us       1.234ms        82.27%       1.234ms     617.000us             2
------------------------------------------------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------  ------------
Self CPU time total: 10.000ms
Self CUDA time total: 1.500ms
""")  # noqa: E501


def _ranked(rank, lines):
    return [(rank, line) for line in lines]


def _interleaved(*per_rank):
    """Lines of several ranks, one of each in turn, as a log of many processes reads."""
    out = []
    longest = max(len(lines) for lines in per_rank)
    for i in range(longest):
        out += [lines[i] for lines in per_rank if i < len(lines)]
    return out


def _row(table, name):
    return next(row for row in table.rows if row[0].text == name)


def _value(table, name, column):
    return _row(table, name)[table.columns.index(column)].value


def test_two_ranks_interleaved_line_by_line_give_one_table_each():
    noise = ["[W reducer.cpp:1360] Warning: find_unused_parameters=True", "epoch 1 loss 0.3"]
    log = _interleaved(_ranked(1, noise + CPU_TABLE + ["done"]), _ranked(0, CPU_TABLE + noise))

    tables = parse_tables(log)

    assert [t.rank for t in tables] == [0, 1]
    for table in tables:
        assert table.columns == CPU_COLUMNS
        assert len(table.rows) == 6
        first = table.rows[0]
        assert first[0] == Cell("enumerate(DataLoader)#_SingleProcessDataLoaderIter._...", None)
        assert first[2] == Cell("81.113ms", 81113.0)
        assert first[1].value == 92.86
        assert first[-1] == Cell("2", 2.0)
        assert _value(table, "DistributedDataParallel.forward", "Self CPU") == 229.093
        assert _value(table, "aten::normal_", "# of Calls") == 16.0
        assert table.totals == ["Self CPU time total: 87.347ms"]


def test_a_log_that_lost_its_trailing_spaces_reads_the_same():
    stripped = [line.rstrip() for line in CPU_TABLE]
    assert stripped != CPU_TABLE

    assert parse_tables(_ranked(0, stripped)) == parse_tables(_ranked(0, CPU_TABLE))


def test_a_cuda_table_with_its_overflowing_header_and_names_with_spaces():
    (table,) = parse_tables(_ranked(3, CUDA_TABLE))

    assert table.rank == 3
    assert table.columns == [
        "Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total", "CPU time avg",
        "Self CUDA", "Self CUDA %", "CUDA total", "CUDA time avg", "# of Calls",
    ]  # fmt: skip
    name = "autograd::engine::evaluate_function: torch::autogra..."
    assert _row(table, name)[0].value is None
    assert _value(table, name, "CUDA total") == 600.0
    assert _value(table, "volta_sgemm_64x64_nn", "Self CUDA") == 1234.0
    assert _value(table, "volta_sgemm_64x64_nn", "Self CUDA %") == 82.27
    assert _value(table, "aten::linear", "CUDA time avg") == 750.0
    assert table.totals == ["Self CPU time total: 10.000ms", "Self CUDA time total: 1.500ms"]


def test_memory_and_input_shapes_columns():
    lines = [
        "-----------------  ------------  ------------  ------------  -------------------------  ",
        "             Name       CPU Mem  Self CPU Mem    # of Calls               Input Shapes  ",
        "-----------------  ------------  ------------  ------------  -------------------------  ",
        "      aten::empty       1.50 Mb        -512 b             3      [[32, 3], [], [], []]  ",
        "       aten::add_       2.00 Gb           0 b             1                         []  ",
        "-----------------  ------------  ------------  ------------  -------------------------  ",
        "Self CPU time total: 1.5s",
    ]

    (table,) = parse_tables(_ranked(0, lines))

    assert table.columns[-1] == "Input Shapes"
    assert _value(table, "aten::empty", "CPU Mem") == 1.5 * 1024 * 1024
    assert _value(table, "aten::empty", "Self CPU Mem") == -512.0
    assert _value(table, "aten::add_", "CPU Mem") == 2.0 * 1024**3
    assert _value(table, "aten::add_", "Self CPU Mem") == 0.0
    assert _row(table, "aten::empty")[-1] == Cell("[[32, 3], [], [], []]", None)


def test_cell_values_in_their_units():
    assert cell_value("Self CPU", "81.113ms") == 81113.0
    assert cell_value("Self CPU", "229.093us") == 229.093
    assert cell_value("CPU total", "1.5s") == 1500000.0
    assert cell_value("CPU total", "12ns") == 0.012
    assert cell_value("Self CPU %", "92.86%") == 92.86
    assert cell_value("CPU Mem", "1.50 MB") == 1.5 * 1024 * 1024  # newer torch: upper case
    assert cell_value("CPU Mem", "-3.00 Kb") == -3072.0
    assert cell_value("Total MFLOPs", "--") is None
    assert cell_value("Name", "12") is None
    assert cell_value("Input Shapes", "[]") is None


def test_garbage_breaks_a_table_and_the_next_good_one_is_still_found():
    broken = CPU_TABLE[:5] + ["Traceback (most recent call last):"] + CPU_TABLE[5:]
    log = (
        ["-----  -----", "garbage", "-------  -------  -------", "x" * 5000]
        + broken
        + ["----------  -----", "   Name    # of Calls", "nonsense"]  # header, never finished
        + CPU_TABLE
        + ["  ".join(["-" * 55] + ["-" * 12] * 6), "           Name  but not a header  "]
    )

    tables = parse_tables(_ranked(0, log))

    assert len(tables) == 1
    assert tables[0] == parse_tables(_ranked(0, CPU_TABLE))[0]


def test_a_table_cut_off_before_its_closing_line_is_not_shown():
    assert parse_tables(_ranked(0, CPU_TABLE[:-2])) == []


def test_work_is_bounded():
    many = CPU_TABLE * (MAX_TABLES + 5)
    assert len(parse_tables(_ranked(0, many))) == MAX_TABLES

    row = CPU_TABLE[4]
    long = CPU_TABLE[:3] + [row] * (MAX_ROWS + 50) + CPU_TABLE[-2:]
    (table,) = parse_tables(_ranked(0, long))
    assert len(table.rows) == MAX_ROWS

    too_long = CPU_TABLE[:4] + [row + " " * 5000] + CPU_TABLE[4:]
    assert parse_tables(_ranked(0, too_long)) == parse_tables(_ranked(0, CPU_TABLE))


def test_random_lines_never_raise():
    rng = random.Random(25)  # noqa: S311 (a fuzz test's repeatable lines)
    alphabet = "- \t%.#:abcdefMGKbsmu0123456789()[],\u00e9\u4e2d\x00\r"
    pieces = CPU_TABLE + CUDA_TABLE
    for _ in range(300):
        log = []
        for _ in range(rng.randint(0, 60)):
            kind = rng.random()
            if kind < 0.4:
                line = rng.choice(pieces)
            elif kind < 0.7:
                line = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))
            else:  # a table line damaged: cut, shifted or with a character changed
                line = rng.choice(pieces)
                at = rng.randint(0, len(line))
                line = line[:at] + rng.choice(["", " ", "x", "--", "  9.9%"]) + line[at + 1 :]
            log.append((rng.randint(-2, 3), line))
        for table in parse_tables(log):
            assert all(len(row) == len(table.columns) for row in table.rows)
    assert parse_tables([(0, None), ("1", "x"), (0,), None, (True, "x")]) == []


def test_the_partial_shows_each_rank_with_sortable_numbers():
    tables = parse_tables(_ranked(1, CUDA_TABLE) + _ranked(0, CPU_TABLE))
    with translation.override("zh-hans"):  # numbers in data-value are never localised
        html = render_to_string("console/_key_averages.html", {"key_averages": tables})

    assert html.count('data-testid="key-averages"') == 2
    assert html.index("进程 0") < html.index("进程 1")
    assert 'data-value="81113.0"' in html
    assert 'data-value="92.86"' in html
    assert 'data-value="0.012"' not in html
    assert html.count("data-sortable") == 2
    assert re.search(r'<th scope="col"[^>]*><button type="button"[^>]*>Name</button></th>', html)
    assert "<td>enumerate(DataLoader)#_SingleProcessDataLoaderIter._...</td>" in html
    assert '<p class="small muted" translate="no">Self CUDA time total: 1.500ms</p>' in html


def test_the_partial_with_nothing_to_show_is_empty():
    assert render_to_string("console/_key_averages.html", {"key_averages": []}).strip() == ""
