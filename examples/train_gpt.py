"""Train a small GPT-like model (fused_block.models.DecoderOnly) with FSDP2 and, optionally,
tensor (and sequence) parallelism, on a synthetic corpus.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py                  # FSDP2 over 2 ranks
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --tp 2 --sp      # 2 (FSDP2) x 2 (TP + SP)

The same command runs on GPUs (NCCL, one GPU per rank, bf16 parameters with fp32 gradient
reduction) and on CPUs (gloo, fp32). On CPUs the fused ops run their Triton kernels through
the interpreter only with ``TRITON_INTERPRET=1`` set (slow: use ``--tiny``), and fused_block's
plain-PyTorch reference otherwise. ``--checkpoint DIR`` saves model and optimizer at the end
with torch.distributed.checkpoint (and resumes from DIR if it holds one).
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from fused_block import distributed, models


def corpus(step, rows, length, vocab):
    """Each row counts up from a random start by a random stride (a learnable toy language)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    return (start + stride * torch.arange(length + 1)) % vocab


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (divides the world size)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism inside the tensor-parallel layers")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank")
    parser.add_argument("--tiny", action="store_true",
                        help="d_model 32, 2 layers, sequences of 16 tokens (for the interpreter)")
    parser.add_argument("--checkpoint", help="a directory for torch.distributed.checkpoint")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda" if cuda else "cpu")
    if world % args.tp:
        raise ValueError(f"--tp {args.tp} does not divide the world size {world}")
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))

    if args.tiny:
        cfg = models.DecoderOnlyConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, d_model=32, dropout=0.1)
        length = 16
    else:
        cfg = models.DecoderOnlyConfig(vocab_size=512, block_size=256, n_layer=6, n_head=8, d_model=512, dropout=0.1)
        length = 256
    torch.manual_seed(0)  # every rank builds the same model and draws the same dropout seeds
    with device:
        model = models.DecoderOnly(cfg)

    if args.tp > 1:  # heads, FFN columns (and the sequence) over the tp dim; embeddings and head replicated
        parallelize_module(model, mesh["tp"], distributed.tp_plan(model, sequence_parallel=args.sp))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else \
        MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy, shard_placement_fn=distributed.fsdp_shard_placement)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    start = torch.zeros((), dtype=torch.int64)
    if args.checkpoint and os.path.exists(os.path.join(args.checkpoint, ".metadata")):
        msd, osd = distributed.get_state_dict(model, opt)  # torch's, DCP-savable with packed TP weights
        dcp.load({"model": msd, "optim": osd, "step": start}, checkpoint_id=args.checkpoint)
        distributed.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        if rank == 0:
            print(f"resumed from {args.checkpoint} at step {start.item()}")

    dp_rank = mesh["dp"].get_local_rank()
    for step in range(start.item(), start.item() + args.steps):
        # The tp ranks of one dp rank take the same rows; each dp rank its own.
        rows = corpus(step, args.batch * mesh["dp"].size(), length, cfg.vocab_size)
        tokens = rows[dp_rank * args.batch:(dp_rank + 1) * args.batch].to(device)
        _, loss = model(tokens[:, :-1], targets=tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)

    if args.checkpoint:
        msd, osd = distributed.get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "step": torch.tensor(step + 1)}, checkpoint_id=args.checkpoint)
        if rank == 0:
            print(f"saved {args.checkpoint}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
