"""A stored log is split where the engine ended its lines (newlines), never where the job's
own text has a carriage return, a form feed or U+2028: otherwise the job chooses the
"timestamp" of a line of its own making (a progress point dated as it likes)."""

from jobs.placement import fleet


def test_a_jobs_own_line_breaks_do_not_start_a_line_with_a_timestamp_it_chose():
    log = (
        "2026-12-07T05:00:00.000000001Z step 1\n"
        "2026-12-07T05:00:01.000000001Z progress\r2099-01-01T00:00:00Z SUANLI_METRIC {}\n"
        "2026-12-07T05:00:02.000000001Z a\u20282099-01-01T00:00:00Z b\x0cc\r\n"
    )
    lines = fleet.stored_log_lines(log)
    assert len(lines) == 3
    stamps = [fleet.split_log_line(line)[0] for line in lines]
    assert stamps == [
        "2026-12-07T05:00:00.000000001Z",
        "2026-12-07T05:00:01.000000001Z",
        "2026-12-07T05:00:02.000000001Z",
    ]
    # The job's text is kept whole, the engine's line end (and a CRLF's CR) taken off.
    assert fleet.split_log_line(lines[1])[1] == "progress\r2099-01-01T00:00:00Z SUANLI_METRIC {}"
    assert fleet.split_log_line(lines[2])[1] == "a\u20282099-01-01T00:00:00Z b\x0cc"
