"""``spark-state``: the operations CLI (also ``python -m spark_state``). Built on click; progress bars by rich.

Every command takes a store URI (a path, ``file://``, ``hdfs://``/``webhdfs://``,
any scheme ``spark_state.storage.open_storage`` knows) and works the same on
every backend. Commands that inspect (``checkpoints``, ``describe``, ``plan``,
``verify``, ``show``, ``savepoint list``) never write; ``savepoint
create/delete``, ``drain`` and ``cleanup`` change the store, and
``repair-checkpoint`` changes only a Spark checkpoint location. ``--json``
prints one JSON document on stdout for scripts; progress bars go to stderr,
only on a terminal.

Exit codes: 0 done; 1 a typed error (the message says what happened and what
to do) or, for ``verify``, a store with problems; 2 bad usage.

To add a command: write what it computes in ``spark_state.ops.inspect`` (or the
module that owns it) as a function returning plain data, then a thin
``@cli.command()`` here that calls it and renders ``--json`` or a table.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from spark_state.errors import SparkStateError
from spark_state.redaction import redact


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=False, width=None if sys.stdout.isatty() else 160)


@contextmanager
def progress_bar(description: str) -> Iterator[Callable[[int, int], None]]:
    """A byte progress bar on stderr (a terminal only); yields ``update(done, total)``."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    console = _console(stderr=True)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    with bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _storage(uri: str):
    """The storage at ``uri``, an ``s3://`` one with the group's S3 options (``cli``) as its parameters."""
    from spark_state.storage import open_storage
    from spark_state.storage.s3_location import apply_settings

    context = click.get_current_context(silent=True)
    settings = context.find_root().obj if context is not None and context.find_root().obj else {}
    return open_storage(apply_settings(uri, settings))


def _store(uri: str):
    """The storage of the store at ``uri``; ``NotAStoreError`` when nothing there is a store (a mistyped path,
    a file): a command never reports success, nor creates anything, where no store is."""
    from spark_state.errors import NotAStoreError
    from spark_state.store.manifestlog import CHECKPOINTS_DIR

    storage = _storage(uri)
    if not storage.exists(CHECKPOINTS_DIR):
        raise NotAStoreError(
            f"{uri} holds no spark-state store (no {CHECKPOINTS_DIR}/ there): check the path; a store exists once a "
            "query committed its first batch to it"
        )
    return storage


def _manifests(uri: str):
    from spark_state.store.manifestlog import ManifestReader

    return ManifestReader(_store(uri))


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=_json_default, sort_keys=False))


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def _table(title: str | None, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_lines=False)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*["" if v is None else str(v) for v in row])
    _console().print(table)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


class _Group(click.Group):
    """Turns typed errors into a one-line message on stderr and exit code 1; click's own errors (a usage error
    quotes the argument it could not take) are redacted too (``redaction``)."""

    group_class = type  # subgroups (``savepoint``) are of this class too

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SparkStateError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(1)
        except click.ClickException as exc:
            exc.message = redact(exc.message)
            raise

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.ClickException as exc:
            exc.message = redact(exc.message)
            raise


JSON = click.option("--json", "as_json", is_flag=True, help="Print one JSON document (for scripts).")
CHECKPOINT = click.option(
    "--checkpoint", "-c", default=None, help="A checkpoint id or a savepoint name (default: the latest)."
)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="spark-state")
@click.option(
    "--endpoint", default=None, help="An s3:// store's endpoint, http(s)://HOST[:PORT] (spark.state.s3.endpoint)."
)
@click.option("--region", default=None, help="An s3:// store's signing region (spark.state.s3.region).")
@click.option(
    "--path-style/--virtual-hosted",
    "path_style",
    default=None,
    help="An s3:// store's addressing (spark.state.s3.pathStyle).",
)
@click.option("--profile", default=None, help="A profile of the AWS config files (spark.state.s3.profile).")
@click.option(
    "--retry-seconds",
    type=click.FloatRange(0, 3600),
    default=None,
    help="How long transient S3 failures are retried (spark.state.s3.retrySeconds).",
)
@click.pass_context
def cli(ctx, endpoint, region, path_style, profile, retry_seconds) -> None:
    """Operate spark-state stores: inspect, verify, plan rescales, read state, savepoints, drain, clean up.

    The S3 options apply to every s3:// STORE, as the spark.state.s3.* settings do to a query's store (or give
    them in the URI: ?endpoint=...&pathStyle=true; the AWS settings of the environment apply too).
    """
    ctx.obj = {
        "endpoint": endpoint,
        "region": region,
        "path_style": None if path_style is None else str(path_style).lower(),
        "profile": profile,
        "retry_seconds": None if retry_seconds is None else str(retry_seconds),
    }


# --------------------------------------------------------------------------- inspect


@cli.command()
@click.argument("store")
@JSON
def checkpoints(store: str, as_json: bool) -> None:
    """List the checkpoints a query can start from, newest first (retained ones and savepoints')."""
    from spark_state.ops.inspect import list_checkpoints

    listed = list_checkpoints(_manifests(store))
    if as_json:
        _emit_json({"store": store, "checkpoints": listed})
        return
    if not listed:
        click.echo(f"{store}: no checkpoint")
        return
    rows = []
    for c in listed:
        components = "; ".join(
            f"{n} p={v['parallelism']} max={v['max_parallelism']}" for n, v in c["components"].items()
        )
        sources = "; ".join(f"{k}: {json.dumps(v, sort_keys=True)}" for k, v in c["sources"].items())
        marks = ", ".join(c["savepoints"]) + ("" if c["retained"] else " (pinned)")
        rows.append(
            [
                c["checkpoint_id"],
                c["committed_at"],
                components,
                sources,
                _size(c["bytes_referenced"]),
                marks.strip(),
                c["batch_id"],
            ]
        )
    _table(
        f"checkpoints of {store}",
        ["id", "committed (UTC)", "components", "sources' offsets", "bytes", "savepoints", "batch"],
        rows,
    )


@cli.command()
@click.argument("store")
@click.argument("component", required=False)
@CHECKPOINT
@click.option("--key-groups", is_flag=True, help="Also list every key group with state (chain, entries, rows).")
@JSON
def describe(store: str, component: str | None, checkpoint: str | None, key_groups: bool, as_json: bool) -> None:
    """Describe a checkpoint, or one COMPONENT of it: schema, instances' key groups, chains, watermark, timers."""
    from spark_state.ops.inspect import describe as describe_checkpoint
    from spark_state.ops.reader import resolve_checkpoint

    manifest = resolve_checkpoint(_manifests(store), checkpoint)
    data = describe_checkpoint(manifest, component)
    if as_json:
        _emit_json(data)
        return
    click.echo(
        f"checkpoint {data['checkpoint_id']} committed {data['committed_at']}"
        + (f", batch {data['binding']['batch_id']} of query {data['binding']['query_id']}" if data["binding"] else "")
        + (" (drained)" if data["drained"] else "")
    )
    for source, offsets in data["sources"].items():
        click.echo(f"  source {source}: {json.dumps(offsets, sort_keys=True)}")
    for c in data["components"]:
        click.echo(
            f"\ncomponent {c['name']}: parallelism {c['parallelism']}, max parallelism {c['max_parallelism']}, "
            f"{c['key_groups_with_state']} key groups with state, {c['blobs']} blobs, {_size(c['bytes'])}"
        )
        keys = ", ".join(f"{k['name']} {k['type']}" for k in c["schema"]["keys"])
        click.echo(f"  keys: {keys}")
        for variable in c["schema"]["variables"]:
            columns = ", ".join(f"{f['name']} {f['type']}" for f in variable["columns"])
            click.echo(f"  state variable {variable['name']}: {columns}")
        click.echo(
            "  chain lengths (entries: key groups): " + ", ".join(f"{n}: {k}" for n, k in c["chain_lengths"].items())
        )
        click.echo(
            f"  watermark: {c['watermark'] or 'none'}; timers: "
            + (
                f"{c['timers']['key_groups_with_timers']} key groups, earliest "
                + json.dumps(c["timers"]["earliest_ms"])
                if c["timers"]["variable"]
                else "none"
            )
        )
        _table(
            None,
            ["instance", "key groups", "with state", "entries", "bytes", "items"],
            [
                [
                    i["instance"],
                    f"{i['key_groups'][0]}-{i['key_groups'][1]}",
                    i["key_groups_with_state"],
                    i["entries"],
                    _size(i["bytes"]),
                    _size(i["items_bytes"]),
                ]
                for i in c["instances"]
            ],
        )
        if key_groups:
            _table(
                None,
                ["key group", "entries", "kinds", "rows", "bytes"],
                [[g["key_group"], g["entries"], ",".join(g["kinds"]), g["rows"], g["bytes"]] for g in c["key_groups"]],
            )


@cli.command()
@click.argument("store")
@click.argument("component")
@click.option("--parallelism", "-p", type=int, required=True, help="The parallelism to plan a restore at.")
@CHECKPOINT
@click.option("--reads", is_flag=True, help="List every byte range each instance reads.")
@JSON
def plan(store: str, component: str, parallelism: int, checkpoint: str | None, reads: bool, as_json: bool) -> None:
    """Dry-run a rescale of COMPONENT: what each new instance would read, and the same at today's parallelism."""
    from spark_state.ops.inspect import plan_rescale
    from spark_state.ops.reader import component_of, resolve_checkpoint

    manifest = resolve_checkpoint(_manifests(store), checkpoint)
    data = plan_rescale(component_of(manifest, component, store), parallelism)
    data["checkpoint_id"] = manifest.checkpoint_id
    if as_json:
        _emit_json(data)
        return
    click.echo(
        f"checkpoint {manifest.checkpoint_id}, component {component}: {_size(data['state_bytes'])} of entries, "
        f"max parallelism {data['max_parallelism']}"
    )
    for label in ("target", "current"):
        part = data[label]
        _table(
            f"{label}: parallelism {part['parallelism']}: {part['requests']} requests, {_size(part['bytes'])} "
            f"(at most {_size(part['max_bytes_per_instance'])} and {part['max_requests_per_instance']} requests per instance)",
            ["instance", "key groups", "with state", "requests", "bytes"],
            [
                [
                    i["instance"],
                    f"{i['key_groups'][0]}-{i['key_groups'][1]}",
                    i["key_groups_with_state"],
                    i["requests"],
                    _size(i["bytes"]),
                ]
                for i in part["instances"]
            ],
        )
        if reads:
            _table(
                None,
                ["instance", "path", "offset", "length", "entries"],
                [
                    [i["instance"], r["path"], r["offset"], r["length"], r["entries"]]
                    for i in part["instances"]
                    for r in i["reads"]
                ],
            )


@cli.command()
@click.argument("store")
@click.option("--deep", is_flag=True, help="Also decode every entry against its index.")
@JSON
def verify(store: str, deep: bool, as_json: bool) -> None:
    """Verify STORE: records parse and chain, referenced files exist with their size and CRC-32. Exit 1 on problems."""
    from spark_state.ops.inspect import verify_store

    with progress_bar("verifying") as update:
        result = verify_store(_manifests(store), deep=deep, progress=update)
    if as_json:
        _emit_json(result)
    else:
        checked = result["checked"]
        click.echo(
            f"{store}: {checked['records']} records, {checked['restorable_checkpoints']} restorable checkpoints, "
            f"{checked['savepoints']} savepoints, {checked['files']} files ({_size(checked['bytes'])}) checked"
        )
        for p in result["problems"]:
            click.echo(f"PROBLEM {p['what']}: {p['path']}: {p['detail']}")
        click.echo("OK" if result["ok"] else f"{len(result['problems'])} problem(s)")
    if not result["ok"]:
        sys.exit(1)


@cli.command()
@click.argument("store")
@click.argument("component")
@CHECKPOINT
@click.option("--key", "key", multiple=True, help="Show only this key (repeat for each key column, in order).")
@click.option("--timers", is_flag=True, help="Add the keys' timers and TTL expiry (timers_* columns).")
@click.option(
    "--limit", type=click.IntRange(min=0), default=None, help="At most this many rows (terminal default: 20)."
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write every row to this file instead (.parquet or .csv).",
)
@JSON
def show(
    store: str,
    component: str,
    checkpoint: str | None,
    key: tuple[str, ...],
    timers: bool,
    limit: int | None,
    output: str | None,
    as_json: bool,
) -> None:
    """Show COMPONENT's keys and values (all, or one --key) on the terminal, as JSON, or into Parquet/CSV."""
    from spark_state.ops.reader import read_state

    with progress_bar("reading state") as update:
        table = read_state(_store(store), component, checkpoint, key=key or None, timers=timers, progress=update)
    if output is not None:
        if not Path(output).parent.is_dir():
            raise click.BadParameter(f"{output}: its directory does not exist; create it first", param_hint="--output")
        _write_table(table, Path(output))
        click.echo(f"wrote {table.num_rows} rows to {output}")
        return
    rows = (
        table.slice(0, limit).to_pylist()
        if limit is not None
        else table.to_pylist()
        if as_json
        else table.slice(0, 20).to_pylist()
    )
    if as_json:
        _emit_json({"component": component, "rows": rows, "total_rows": table.num_rows})
        return
    _table(None, table.column_names, [[r[c] for c in table.column_names] for r in rows])
    more = table.num_rows - len(rows)
    click.echo(f"{table.num_rows} rows" + (f" ({more} more: use --limit, --json or --output)" if more > 0 else ""))


def _write_table(table, path: Path) -> None:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, path)
    elif suffix == ".csv":
        import pyarrow.csv as csv

        csv.write_csv(table, path)
    else:
        raise click.BadParameter(f"{path}: use a .parquet or .csv file name", param_hint="--output")


# --------------------------------------------------------------------------- savepoints


@cli.group()
def savepoint() -> None:
    """Create, list and delete savepoints (named checkpoints that cleanup never deletes)."""


@savepoint.command("create")
@click.argument("store")
@click.argument("name")
@CHECKPOINT
@click.option("--reason", default="", help="Why (kept in the record).")
@JSON
def savepoint_create(store: str, name: str, checkpoint: str | None, reason: str, as_json: bool) -> None:
    """Pin a checkpoint (default: the latest) of STORE as savepoint NAME."""
    from spark_state.store.savepoints import create_savepoint

    if checkpoint is not None and not checkpoint.isdigit():
        raise click.BadParameter(
            f"{checkpoint!r}: give a checkpoint id (a number, as `checkpoints` lists them)", param_hint="--checkpoint"
        )
    created = create_savepoint(_manifests(store), name, None if checkpoint is None else int(checkpoint), reason=reason)
    if as_json:
        _emit_json({**created.to_json(), "uri": created.uri})
        return
    click.echo(f"savepoint {created.name} pins checkpoint {created.checkpoint_id}: {created.uri}")
    for source, offsets in created.sources.items():
        click.echo(f"  source {source}: {json.dumps(offsets, sort_keys=True)}")


@savepoint.command("list")
@click.argument("store")
@JSON
def savepoint_list(store: str, as_json: bool) -> None:
    """List STORE's savepoints, newest checkpoint first (damaged records too)."""
    from spark_state.ops.inspect import iso
    from spark_state.store.savepoints import Savepoints

    listing = Savepoints(_store(store)).list()
    if as_json:
        _emit_json(
            {
                "savepoints": [{**s.to_json(), "uri": s.uri} for s in listing.savepoints],
                "damaged": dict(listing.damaged),
            }
        )
        return
    _table(
        f"savepoints of {store}",
        ["name", "checkpoint", "created (UTC)", "components", "sources' offsets", "uri"],
        [
            [
                s.name,
                s.checkpoint_id,
                iso(s.created_at),
                "; ".join(
                    f"{n} p={c.parallelism} max={c.max_parallelism} keys={','.join(c.key_columns)}"
                    for n, c in s.components.items()
                ),
                "; ".join(f"{k}: {json.dumps(v, sort_keys=True)}" for k, v in s.sources.items()),
                s.uri,
            ]
            for s in listing.savepoints
        ],
    )
    for name, detail in listing.damaged.items():
        click.echo(f"DAMAGED {name}: {detail}")


@savepoint.command("delete")
@click.argument("store")
@click.argument("name")
def savepoint_delete(store: str, name: str) -> None:
    """Delete savepoint NAME's record; what only it needed goes at the next cleanup."""
    from spark_state.store.savepoints import Savepoints

    Savepoints(_store(store)).delete(name)  # SavepointNotFoundError names the ones there are
    click.echo(f"deleted savepoint {name}")


# --------------------------------------------------------------------------- act


@cli.command()
@click.argument("store")
@click.argument("run_id")
@click.option("--reason", default="", help="Why (kept in the request).")
@click.option("--force", is_flag=True, help="Ask even a run the store has not seen commit (one that just started).")
def drain(store: str, run_id: str, reason: str, force: bool) -> None:
    """Ask the run RUN_ID (Spark's query.runId) of the query writing STORE to drain and stop."""
    from spark_state.ops.inspect import check_drainable
    from spark_state.store.drain import request_drain

    storage = _store(store)
    if not force:
        check_drainable(_manifests(store), run_id)
    path = request_drain(storage, run_id, reason=reason)
    click.echo(
        f"requested a drain of run {run_id}: {store.rstrip('/')}/{path} (it takes effect at the next micro-batch, which the query's clock runs on an idle source)"
    )


@cli.command()
@click.argument("store")
@click.option("--dry-run", is_flag=True, help="Only list what would be deleted.")
@click.option(
    "--grace-seconds",
    type=click.FloatRange(min=0),
    default=None,
    show_default="3600",
    help="Keep unreferenced files younger than this (attempts that may still be running).",
)
@JSON
def cleanup(store: str, dry_run: bool, grace_seconds: float | None, as_json: bool) -> None:
    """Delete what no retained checkpoint and no savepoint of STORE needs (records first, then files)."""
    from spark_state.store.manifestlog import DEFAULT_ORPHAN_GRACE_SECONDS, ManifestLog, manifest_path

    grace = DEFAULT_ORPHAN_GRACE_SECONDS if grace_seconds is None else grace_seconds
    log = ManifestLog(_store(store))
    latest = log.latest()
    if latest is None:
        raise click.ClickException(f"{store} holds no checkpoint; nothing to clean up")
    plan = log.plan_cleanup(latest, grace_seconds=grace)
    paths = [manifest_path(i) for i in plan.records] + list(plan.files)
    size = 0
    for path in plan.files:
        try:
            size += log.storage.size(path)
        except SparkStateError:
            continue
    if not dry_run:
        paths = log.execute_cleanup(plan)  # exactly what was listed and sized above
    data = {
        "store": store,
        "dry_run": dry_run,
        "after_checkpoint": latest.checkpoint_id,
        "records": list(plan.records),
        "files": list(plan.files),
        "bytes": size,
    }
    if as_json:
        _emit_json(data)
        return
    verb = "would delete" if dry_run else "deleted"
    for path in paths:
        click.echo(f"{verb} {path}")
    click.echo(f"{verb} {len(plan.records)} records and {len(plan.files)} files ({_size(size)})")


@cli.command("repair-checkpoint")
@click.argument("location")
@click.option("--dry-run", is_flag=True, help="Only say what would be deleted.")
def repair_checkpoint(location: str, dry_run: bool) -> None:
    """Repair a Spark checkpoint LOCATION whose first offsets write was interrupted (only its leftovers go)."""
    from spark_state.spark.checkpoint import interrupted_first_batch
    from spark_state.storage.base import join

    storage = _storage(location)
    doomed = interrupted_first_batch(storage.list("offsets"), storage.list("commits"), storage.uri)
    if not doomed:
        click.echo(f"{location}: nothing to repair")
        return
    for name in doomed:
        if not dry_run:
            storage.delete(join("offsets", name))
        click.echo(f"{'would delete' if dry_run else 'deleted'} offsets/{name}")
    if not dry_run:
        click.echo("the query can start again")


def main(argv: list[str] | None = None) -> None:
    """The console script ``spark-state``."""
    cli.main(args=argv, prog_name="spark-state")


if __name__ == "__main__":
    main()
