"""`jetserve mtp ...`: tools for checkpoints with multi-token-prediction heads; `jetserve plan`:
the memory plan of a configuration on a Jetson board or on this machine.

Imports only the standard library at module level and parses on Python 3.8 (`jetserve.cli`
imports every part's cli module, also on devices without torch); the work is imported inside
the commands.
"""

import json
import os
import sys


def register(subparsers):
    actions = mtp_actions(subparsers)
    add_inspect(actions)
    add_merge(actions)
    add_fit(actions)
    add_plan(subparsers)
    add_tune(subparsers)


def add_tune(subparsers):
    p = subparsers.add_parser(
        "tune", help="time the matmul tiles of a model on this GPU (install time, or a bench machine)",
        description="Start an engine that times every candidate tile of every skinny product it runs (what a "
                    "serving engine never does: it takes the shipped tile table) and keep the choices in the tile "
                    "cache, where every later start on this GPU and software reads them first. With --out, also "
                    "write a tile table for this GPU family (the shipped one with these shapes replaced), to ship "
                    "in jetserve/engine/model/tiles/. --from-cache builds that table from tile cache files "
                    "instead, without an engine.", conflict_handler="resolve")
    p.add_argument("--out", metavar="FILE", help="write a tile table (JSON) for this GPU family")
    p.add_argument("--from-cache", nargs="+", metavar="JSON", help="tile cache files to make the table of")
    p.add_argument("--family", help="the table's GPU family with --from-cache, e.g. sm90 (default: the cache's)")
    if _add_engine_flags(p, "tune"):
        p.set_defaults(func=_tune)


def _tune(args):
    from jetserve.engine.tune import table_from_caches, tune

    try:
        table = table_from_caches(args.from_cache, args.family) if args.from_cache else tune(args)
    except (ValueError, OSError) as exc:
        print("jetserve tune: %s" % exc, file=sys.stderr)
        return 2
    if args.out:
        with open(args.out, "w") as f:
            f.write(table.to_json())
        print("tile table for %s: %d shapes written to %s" % (table.name, len(table.shapes), args.out))
    return 0


def add_plan(subparsers):
    p = subparsers.add_parser(
        "plan", help="will a model fit a Jetson: weights, KV cache, activations, graphs",
        description="Print the memory a configuration needs (weights as loaded, quantized or not; KV cache at "
                    "max_model_len x max_num_seqs; activations; CUDA graphs; runtime) against what a board leaves "
                    "beside its OS, and the batch-1 decode speed its bandwidth allows. Reads metadata only. "
                    "Exit status 1 when it does not fit.", conflict_handler="resolve")
    if not _add_engine_flags(p, "plan"):
        return
    p.add_argument("--device", default="this",
                   help="orin-nano-8gb, orin-nx-16gb, agx-orin-32gb, agx-orin-64gb, thor, or this (this machine's "
                        "free memory now; default)")
    p.set_defaults(func=_plan)


def _add_engine_flags(p, command) -> bool:
    """The engine's flags on `p`; False (and a command that says what is missing) where the
    engine's modules are not installed (a device with the agent alone)."""
    try:
        from jetserve.engine.config import EngineArgs
    except ModuleNotFoundError as exc:
        missing = exc.name
        p.set_defaults(func=lambda args: sys.exit("jetserve %s: Python module %r is not installed" % (command, missing)))
        return False
    EngineArgs.add_cli_args(p)
    return True


def _plan(args):
    import os
    import tempfile

    from jetserve.engine.plan import known_shapes, shape_config

    shape = shape_config(args.model) if args.model and not os.path.exists(args.model) else None
    if shape is None:
        return _plan_for(args)
    with tempfile.TemporaryDirectory(prefix="jetserve-plan-") as scratch:
        from jetserve.engine.plan import shape_checkpoint

        name, args.model = args.model, str(shape_checkpoint(shape, os.path.join(scratch, args.model)))
        print("%s: the shape of Hugging Face's %s (config.json shipped with jetserve, no weights; "
              "known shapes: %s)" % (name, "Qwen/Qwen3-" + name.split("-", 1)[1].upper(),
                                     ", ".join(known_shapes())))
        return _plan_for(args)


def _plan_for(args):
    from jetserve.engine.config import EngineArgs
    from jetserve.engine.plan import known_shapes, memory_plan

    board = args.device
    args.device = "auto"
    try:
        config = EngineArgs.from_cli_args(args).resolve(device=None if board == "this" else "cuda")
        plan = memory_plan(config, board)
    except (ValueError, OSError) as exc:
        hint = ("" if not args.model or os.path.exists(args.model) else
                " (--model takes a checkpoint directory or a known shape: %s)" % ", ".join(known_shapes()))
        print("jetserve plan: %s%s" % (exc, hint), file=sys.stderr)
        return 2
    print(plan.table(config))
    return 0 if plan.fits else 1


def mtp_actions(subparsers):
    """Add `jetserve mtp` and return its sub-subparsers, where each action adds itself."""
    mtp = subparsers.add_parser("mtp", help="inspect, merge or train MTP (multi-token prediction) heads",
                                description="Inspect, merge or train MTP (multi-token prediction) heads.")
    mtp.set_defaults(func=lambda args: mtp.print_help() or 2)
    return mtp.add_subparsers(dest="mtp_action", metavar="ACTION")


def add_inspect(actions):
    p = actions.add_parser("inspect", help="does a checkpoint have MTP heads, how many, how big",
                           description="Report a checkpoint's MTP heads from metadata only (no weights are read).")
    p.add_argument("dir", metavar="DIR", help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run(_inspect))


def add_merge(actions):
    p = actions.add_parser("merge", help="merge separately shipped MTP heads into a new checkpoint",
                           description="Write BASE plus the MTP heads of MTP_SRC as a new sharded checkpoint "
                                       "in OUT. The inputs are never modified.")
    p.add_argument("base", metavar="BASE", help="checkpoint directory without MTP heads")
    p.add_argument("mtp_src", metavar="MTP_SRC", help="a .safetensors file or a directory holding the heads")
    p.add_argument("out", metavar="OUT", help="new checkpoint directory (must be empty or absent)")
    p.add_argument("--max-shard-size", default="5GB", help="largest shard, e.g. 5GB or 500MB (default 5GB)")
    p.add_argument("--force", action="store_true", help="replace OUT when it is not empty")
    p.add_argument("--replace", action="store_true", help="drop MTP heads BASE already has instead of refusing")
    p.set_defaults(func=_run(_merge))


def add_fit(actions):
    p = actions.add_parser("fit", help="train MTP heads for a checkpoint that has none",
                           description="Train MTP head(s) for a checkpoint without them: the base stays frozen and "
                                       "the heads learn to match its own next-next-token distribution (KL "
                                       "distillation). Writes base + heads as a new checkpoint in OUT.")
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory without MTP heads")
    p.add_argument("--data", required=True, nargs="+", metavar="FILE", help="text files to train on")
    p.add_argument("--out", required=True, metavar="DIR", help="new checkpoint directory (must be empty or absent)")
    p.add_argument("--num-layers", type=int, default=1, help="MTP layers to train (default 1)")
    p.add_argument("--depth", type=int, default=2,
                   help="chained draft steps trained (default 2; the engine reuses the layer past that)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace OUT when it is not empty")
    p.set_defaults(func=_run(_fit))


def _run(command):
    """Bad input (ValueError, which CheckpointError is) or I/O errors: one line on stderr, exit 2."""
    def run(args):
        try:
            return command(args)
        except (ValueError, OSError) as exc:
            print("jetserve mtp %s: %s" % (args.mtp_action, exc), file=sys.stderr)
            return 2
    return run


def _inspect(args):
    from jetserve.engine.offline.mtp_checkpoint import inspect

    report = inspect(args.dir)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if report["has_mtp"]:
        heads = "yes, %d tensors named %s (%s style)" % (report["mtp_tensors"], report["naming"], report["style"])
    else:
        heads = "no"
    layers = "%d in tensors, %d in config.json" % (report["found_layers"], report["config_layers"])
    if not report["layers_match"]:
        layers += "  <- MISMATCH"
    rows = [
        ("checkpoint", report["dir"]),
        ("MTP heads", heads),
        ("MTP layers", layers),
        ("MTP params", "{:,} of {:,} ({:.2%} of all weights)".format(
            report["mtp_params"], report["total_params"], report["mtp_share"])),
        ("dtypes", ", ".join(report["dtypes"]) + (
            "  (MTP: %s)" % ", ".join(report["mtp_dtypes"]) if report["mtp_dtypes"] else "")),
        ("files", ", ".join(report["files"])),
    ]
    for key, value in rows:
        print("%-11s %s" % (key, value))
    return 0


def _merge(args):
    from jetserve.engine.offline.mtp_checkpoint import merge

    result = merge(args.base, args.mtp_src, args.out, max_shard_size=args.max_shard_size,
                   force=args.force, replace=args.replace)
    print("wrote %s: %d MTP layer(s) in %s style (%d tensors), %d shard(s), %s bytes" % (
        result["out_dir"], result["mtp_layers"], result["style"], result["mtp_tensors"],
        result["shards"], "{:,}".format(result["total_size"])))
    return 0


def _fit(args):
    from jetserve.engine.offline.mtp_fit import fit

    result = fit(args.model, args.data, args.out, num_layers=args.num_layers, steps=args.steps,
                 batch_size=args.batch_size, seq_len=args.seq_len, depth=args.depth, lr=args.lr,
                 device=args.device, seed=args.seed, force=args.force)
    print("wrote %s: %d MTP layer(s) trained %d steps on %s tokens; final KL %.4f, top-1 agreement by depth %s" % (
        result["out_dir"], result["num_layers"], result["steps"], "{:,}".format(result["tokens"]),
        result["final_kl"], " / ".join("%.2f" % a for a in result["final_agreement"])))
    return 0
