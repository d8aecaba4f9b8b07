"""JSONL batch I/O of `nanoinfer generate` and `nanoinfer embed`: input lines -> requests, outputs -> records, resume.

Knows nothing about models or the engine; one module a job: reader, lines (JSON checks), requests (native lines),
openai (every OpenAI batch shape), records, embed (embed's lines and records), writer, manifest (resume).
Tokenizing and running the requests is `jobs/`'s.
"""
