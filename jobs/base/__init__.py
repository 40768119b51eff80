"""The ground every other package stands on; it imports no model and nothing else of jobs/.

- `validators`: checks on what operators and researchers type (image references, host names,
  addresses, own-image names), with messages that say what to write; models and migrations use them.
- `addresses`: which addresses are public, and every spelling of an IP address a resolver accepts.
- `crypto`: secrets at rest (a text field PostgreSQL only sees encrypted).
- `text`: words composed now and shown later in the reader's language (`Text`).
- `sql`: set-based writes the ORM spells slowly (`insert_rows`, `update_rows`).
- `queue`: queueing a higher package's task by its dotted name, never by importing it.
- `outage`: how a long-running process lives through a Redis or PostgreSQL outage.
- `logstore`: a log's recent lines, numbered, in a Redis list.

Layer: base, the bottom of jobs/.
"""
