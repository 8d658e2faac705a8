"""A request prefilled in one engine and decoded in another, as the two pools run it, for the
engine tests that compare it with one engine."""

from engine.outputs import Completion


def split_run(prefill, decode, rid, prompt, params, resumed=(), shown=0):
    """What a client gets when `prompt` is prefilled in `prefill` and decoded in `decode`: the
    prefill's first token (text and logprobs) at once, then the decode engine's output after it.
    A request resumed after `resumed` output tokens (none: a fresh one), of which the client was
    shown `shown` characters, gets what comes after them. Returns that and the last output (its
    counts). The decode engine reuses the K/V its prefix cache holds (`reserve_cached`): a
    prompt it received or decoded before is sent only from where it differs."""
    resumed = list(resumed)
    prefill.add_request(rid, prompt, params, hold_blocks=True, resumed=resumed, shown_chars=shown)
    got, last = Completion(rid, prompt), None
    while prefill.has_work():
        for last in prefill.step():
            got.add(last)
    if got.finish_reason is not None:
        prefill.release(rid)
        return got, last
    # as the pools do: the decode engine takes the leading blocks its prefix cache holds, only the
    # rest is sent (decode_service/server.py, prefill_service/server.py)
    blocks, cached = decode.reserve_cached(list(prompt) + resumed)
    kv = prefill.runner.export_blocks(prefill.held_blocks(rid)[cached:])
    prefill.release(rid)
    decode.import_kv(blocks[cached:], kv)
    last = decode.add_prefilled(rid, prompt, got.token_ids[0], params, blocks, shown + len(got.text), resumed=resumed)
    assert last.new_token_ids == got.token_ids and not last.logprobs
    got.text += last.new_text
    got.finish_reason = last.finish_reason
    while decode.has_work():
        for last in decode.step():
            got.add(last)
    return got, last
