"""kv_transfer: move a request's KV blocks from a prefill replica's pool into a decode
replica's pool.

Both pools have the engine's block-major layout `[num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim]` (one block is contiguous across layers); a request's KV is a list of
block ids into dim 0. The engine allocates and frees blocks; this package only reads and
writes the blocks it is handed, and says when it is done. The bottom layer, beside `engine/`:
it imports neither that nor anything above it (import-linter checks it in `make test`).

Public API (two backends, one interface: see base.py):

    receiver = KVReceiver(kv, fingerprint, config, host="127.0.0.1")   # decode side
    receiver.address                                  # "host:port", publish it
    fut = receiver.expect(request_id, block_ids)      # Future[TransferResult]; .meta on landing
    receiver.cancel(request_id); receiver.state(request_id); receiver.health(); receiver.close()

    sender = KVSender(kv, fingerprint, config)        # prefill side
    result = sender.send(receiver_address, request_id, block_ids, meta=b"")   # blocking
    sender.cancel(request_id)                         # drop a send still waiting for a pair
    sender.abort(receiver_address, request_id, reason); sender.close()

    LoopbackReceiver / LoopbackSender: same API, one process, pool-to-pool copies.
    fingerprint_for(kv, model_id), choose_backend(local, peer), TransferConfig.

From asyncio, `await asyncio.wrap_future(fut)` on the decode side and
`await loop.run_in_executor(None, sender.send, ...)` on the prefill side.

Life cycle of one transfer
--------------------------
1. Decode: the engine allocates blocks and calls `expect(request_id, block_ids)` (PENDING),
   before the sender has anything to send. The decode replica's address and the request id
   (the reservation's identity) travel to the prefill side with the request (router's job).
2. Prefill: after prefill, `send(address, request_id, block_ids, meta)`. A send takes an idle
   pair to that address or builds one (up to max_pairs_per_peer per address): a Handshake
   through the receiver's TCPStore (fingerprint, device, optional secret proof), a
   HandshakeReply, then a 2-rank process group (receiver rank 0, sender rank 1): NCCL when
   both pools are on CUDA on distinct GPUs, else gloo. Pairs are cached; one process can be
   in many pairs; there is no global world.
3. The sender pushes a TransferHeader (with `meta`) on the pair's frame queue in the store,
   then the blocks as segments (messages) of at most `chunk_bytes` (at least one block) over
   the group. The receiver's pair thread takes the reservation to TRANSFERRING (a header
   whose reservation does not exist is refused at once: nothing waits for a reservation) and
   writes each segment into the reserved blocks. CPU pools on gloo send every segment straight from the pool and receive it
   straight into the pool whatever the block layout; a CUDA pool on gloo, a fragmented pool on
   NCCL, and a segment whose destination is not one run go through two bounded staging buffers
   (pipeline.py).
4. The receiver resolves the future (DONE, with the sender's `meta`) and pushes an Ack; the
   sender returns its result.
A pair carries one transfer at a time; the pairs between one sender and one receiver (up to
max_pairs_per_peer) and pairs to other receivers run in parallel (a receiver thread per pair),
so a slow, stalled or refused transfer holds only its own pair.

Block ownership
---------------
Decode (receiver):  reserved (expect) -> receiving (pair thread writes) -> landed (future ok:
    the engine owns the blocks again and uses them) or failed (future error: the engine frees
    them). The future resolves exactly once, and only when nothing will write the blocks again:
    a transfer in progress when its reservation is cancelled or its lease ends stops writing
    (at most WINDOW = 8 more segments land, still inside the reserved blocks), drains the rest,
    and is then resolved; a transfer that fails closes its channel before it resolves. A transfer for an unknown or expired id is drained and answered
    with a negative Ack, so the pair stays in sync.
Prefill (sender):   the caller holds its blocks during send() and frees them when send()
    returns, whatever the result; send() only reads them, and never after returning.

Timeouts (TransferConfig; every wait has one)
---------------------------------------------
connect_timeout_s = 10     building a pair (store connect, handshake, group rendezvous)
transfer_timeout_s = 30    one transfer on its pair (data + ack); also the wait for a free pair
lease_s = 60               a reservation's life: after it the future resolves with a timeout
                           error (at worst lease_s + transfer_timeout_s if data is in flight)
chunk_bytes = 0 (auto)     largest data message: 4 MiB on gloo, 32 MiB on NCCL (a block larger
                           than that travels alone); staging is at most 2 messages per pair
                           and side, allocated on first need
pair_idle_timeout_s = 600  the receiver drops a pair idle this long (reclaims dead senders);
                           the sender rebuilds it on its next send
max_pairs = 64             pairs a receiver accepts
max_pairs_per_peer = 4     pairs a sender keeps to one receiver (transfers in flight to it);
                           a send finding all busy waits for one, within transfer_timeout_s
secret = "" (no authentication)
A dead peer surfaces as an error value within these bounds: the sender's send() returns
ok=False (the connection closes at once, or a timeout fires); the receiver fails the
reservation whose data was in flight, and any other reservation at its lease.

Failure handling: any fault tears the pair down (NCCL is aborted) and the next send builds a
new one; a fast fault (not a timeout) on a pair that had carried earlier transfers is retried
once on a fresh pair. TCPStore reads against a remote store can block forever on a frozen
peer despite their own timeouts, so the sender bounds them from a helper thread.

Wire: control messages are msgpack (protocol.py, versioned, size-capped); KV travels only as
raw tensor bytes over the process group; nothing is pickled.
"""

from kv_transfer.base import KVReceiverBase, KVSenderBase, TransferResult, TransferState
from kv_transfer.config import TransferConfig
from kv_transfer.layout import choose_backend, fingerprint_for
from kv_transfer.loopback import LoopbackReceiver, LoopbackSender
from kv_transfer.protocol import DeviceInfo, Fingerprint, ProtocolError
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender

__all__ = [
    "DeviceInfo", "Fingerprint", "KVReceiver", "KVReceiverBase", "KVSender", "KVSenderBase",
    "LoopbackReceiver", "LoopbackSender", "ProtocolError", "TransferConfig", "TransferResult",
    "TransferState", "choose_backend", "fingerprint_for",
]
