"""Jobs on the engines: one container per node started, followed to its end, stopped and
repaired after a crash (`runner`), and live logs with one follower per replica (`livelogs`).

Layer: runs, beside access and images; uses nodes, placement and below.
"""
