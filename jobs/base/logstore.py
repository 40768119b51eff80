"""A log's recent lines, numbered, in a Redis list: the store that a late viewer reads
before the lines its socket's group brings (console/consumers.py, `_NumberedLines`). Each
item is `<seq>\\t<text>`; the list keeps its last `keep` items.

Two writers: an image build numbers its own lines (one writer, `push`); a job's log is
written by the follower threads of its replicas (`append`), which number them in Redis,
atomically with the push, so that the list is always in order and a restarted follower
goes on from the last number.

Layer: base (beside queue, sql and outage); uses no other part."""

import redis
from django.conf import settings

# KEYS: list, counter, marks (a hash). ARGV: keep, list ttl, counter ttl, n marks, then
# n (field, value) pairs, then the texts. Returns the first number given.
_APPEND = """
local n_marks = tonumber(ARGV[4])
local first_text = 5 + 2 * n_marks
local count = #ARGV - first_text + 1
local last = redis.call('INCRBY', KEYS[2], count)
local seq = last - count
for i = first_text, #ARGV do
  seq = seq + 1
  redis.call('RPUSH', KEYS[1], seq .. '\\t' .. ARGV[i])
end
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[1]), -1)
for i = 0, n_marks - 1 do
  redis.call('HSET', KEYS[3], ARGV[5 + 2 * i], ARGV[6 + 2 * i])
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3]))
return last - count + 1
"""


def connect() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=10)


def push(conn: redis.Redis, key: str, lines, *, keep: int, ttl: int) -> None:
    """Lines numbered by their one writer: [(seq, text), ...]."""
    pipe = conn.pipeline()
    pipe.rpush(key, *[f"{seq}\t{text}" for seq, text in lines])
    pipe.ltrim(key, -keep, -1)
    pipe.expire(key, ttl)
    pipe.execute()


def append(
    conn: redis.Redis,
    key: str,
    texts: list[str],
    *,
    keep: int,
    ttl: int,
    counter_ttl: int,
    marks: dict[str, str] | None = None,
) -> int:
    """Numbers `texts` after the log's last line and keeps them, with the writers' marks
    (where each got to) in the same step; the number of the first."""
    marks = marks or {}
    pairs = [part for item in marks.items() for part in item]
    return int(
        conn.eval(
            _APPEND,
            3,
            key,
            f"{key}:seq",
            f"{key}:marks",
            keep,
            ttl,
            counter_ttl,
            len(marks),
            *pairs,
            *texts,
        )  # fmt: skip
    )


def marks(conn: redis.Redis, key: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (conn.hgetall(f"{key}:marks") or {}).items()}


def read(conn: redis.Redis, key: str) -> list[tuple[int, str]]:
    """The kept lines, in order: [(seq, text), ...]."""
    out = []
    for item in conn.lrange(key, 0, -1):
        seq, _, text = item.decode("utf-8", "replace").partition("\t")
        out.append((int(seq), text))
    return out
