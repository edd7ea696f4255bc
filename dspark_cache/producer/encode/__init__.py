"""Rows into samples: messages, chat template, loss mask, tokens, in worker processes.

* ``messages``: a row normalised to messages and tools (``normalise_row``), as NeMo does.
* ``template``: the chat template argument, the template and tokenizer identities the manifest
  records, and renders bounded in time and size.
* ``chat``: ``ChatEncoder``, the chat template applied with NeMo's loss-mask rules, giving an
  ``EncodedRow``.
* ``text``: comparing renders (common prefixes and suffixes, turn ends, lone surrogates).
* ``tokens``: the first tokens of a text, known to equal the whole text's (bounded memory).
* ``pool``: the encoder run over every row, in process or in forked workers (``encode_rows``).

The rest of the producer uses ``ChatEncoder``, ``EncodedRow`` (``chat``), ``normalise_row``
(``messages``), ``encode_rows`` (``pool``) and ``resolve_chat_template``, ``sha256_text``,
``tokenizer_sha256`` (``template``).
"""
