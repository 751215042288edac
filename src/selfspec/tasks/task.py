"""Task base class, registry and the loading shared by every task.

A task turns a data set into :class:`Example` s (prompt text before chat templating, the
reference its metric needs, metadata), renders prompts for a tokenizer, post-processes
generations and scores them. Records come from one of three sources:

``hub``      ``datasets.load_dataset(hub_id, hub_config, split=split)`` (needs the hub);
``local``    ``data_files``: JSON-lines files or JSON arrays of records (what ``datasets``' json
             loader reads; ``.gz`` too, globs expanded), same schema as the hub set;
``offline``  the package-shipped asset of :mod:`selfspec.store.assets` (the default here).

Every record is checked when it is read (:func:`check_record`: the task's ``required`` fields and
types, then :meth:`Task.record_problem`), so a malformed file stops with one
:class:`TaskDataError` naming the file, the line (JSON lines) or index (JSON array) and the field
— before any model is loaded, since the entry points read the examples first.

Selection follows the research code (docs/design/reproduction.md §6, Draft & Verify): the pool is shuffled with
``shuffle_seed`` (the permutation ``datasets.Dataset.shuffle(seed=...)`` uses), the first
``shots`` records become the in-context exemplars, and the next ``n_examples`` are evaluated.

Prompt formats (``prompt_format``; docs/design/reproduction.md §6, "Prompt formats"): ``paper`` is the papers'
raw text prompt (k-shot ``Article: …\\nSummary:``, HumanEval's bare signature); ``chat`` is the
task's instruction as chat turns (each exemplar an earlier user/assistant exchange) through the
tokenizer's chat template, with the task's own stop strings and answer extraction; ``auto`` (the
default) is ``chat`` for a model whose config says ``chat: true`` (an instruct model) and
``paper`` otherwise. The paper presets (``conf/experiment/``) pin ``paper``.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import hashlib
import json
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from omegaconf import DictConfig, OmegaConf

from selfspec.config import checks
from selfspec.config.registry import Registry

__all__ = [
    "Example",
    "Task",
    "TaskDataError",
    "TASKS",
    "TaskConfig",
    "cut_at",
    "build_task",
    "model_chat",
    "get_task",
    "read_jsonl",
    "read_records",
    "render",
]

class TaskDataError(ValueError):
    """A data file or record is malformed; the message names file, line and field."""


@dataclass
class Example:
    """One evaluation item: ``prompt`` is the model input text before chat templating;
    ``messages`` (the ``chat`` prompt format) are the chat turns the model reads instead."""

    id: str
    prompt: str
    reference: Any
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] | None = None


#: task name -> its class (imported on first use), in the papers' order (tables, figures); each
#: task's title and score column its class's (the one registry style, :mod:`selfspec.config.registry`)
TASKS = Registry("task", {
    "xsum": "selfspec.tasks.xsum:XSum",
    "cnndm": "selfspec.tasks.cnndm:CnnDm",
    "humaneval": "selfspec.tasks.humaneval:HumanEval",
    "gsm8k": "selfspec.tasks.gsm8k:GSM8K",
    "mtbench": "selfspec.tasks.mtbench:MTBench",
}, lambda name, known: KeyError(f"unknown task {name!r}; known tasks: {', '.join(known)}"))


def get_task(name: str) -> type[Task]:
    """The task class named ``name``."""
    return TASKS.lookup(name)


def model_chat(cfg: Any) -> bool:
    """The ``chat`` key of a composed config's model (``cfg.model``): whether it is an instruct model
    (``prompt_format=auto`` follows it); false when absent. Checked by
    :func:`selfspec.models.loading.check_model_config` (``model.chat``)."""
    model = cfg.get("model") if hasattr(cfg, "get") else getattr(cfg, "model", None)
    value = model.get("chat") if hasattr(model, "get") else getattr(model, "chat", None)
    return bool(checks.flag("model.chat", False if value is None else value))


def build_task(cfg: Mapping[str, Any], *, model_chat: bool = False, **replace: Any) -> Task:
    """Instantiate a task from its config (``conf/task/<name>.yaml``, or a plain dict).

    ``model_chat``: the model config's ``chat`` key (an instruct model), which
    ``prompt_format=auto`` follows. ``replace``: options the caller sets instead of the config's
    (e.g. the whole pool for training: ``n_examples=None``), applied after every config value
    was checked.
    """
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    options = dict(cfg)
    name = options.pop("name", None)
    if name is None:
        raise ValueError("task config has no 'name' key")
    task = get_task(name)(model_chat=model_chat, **options)
    if replace:
        task.cfg = dataclasses.replace(task.cfg, **replace)
        task.cfg.check(name)
    return task


#: field -> type(s) a record must have
Required = Mapping[str, type | tuple[type, ...]]
#: a task's extra check of one record: a message for what is wrong with it, or None
Problem = Callable[[dict[str, Any]], str | None]


def _read_text(path: Path) -> str:
    """A data file's text (``.gz`` decompressed), or a :class:`TaskDataError` naming the file when it
    is not UTF-8 or not gzip (issue 39: a raw UnicodeDecodeError or BadGzipFile named no file)."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                data = f.read()
        else:
            data = Path(path).read_bytes()
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise TaskDataError(f"{path}: cannot be decompressed as gzip ({err}); give the plain file, or "
                            "compress it again") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise TaskDataError(f"{path}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
                            "convert it, e.g. iconv -f latin1 -t utf-8") from None


def read_jsonl(path: Path, required: Required, skip_comments: bool = False,
               problem: Problem | None = None) -> list[dict[str, Any]]:
    """Read a JSON-lines file, checking that every record has the ``required`` fields.

    Blank lines are skipped, and lines starting with ``#`` too when ``skip_comments``.
    Raises :class:`TaskDataError` naming the file, the line and the field at fault.
    """
    return _jsonl_records(_read_text(path).splitlines(), path, required, skip_comments, problem)


def _jsonl_records(lines: Iterable[str], path: Path, required: Required, skip_comments: bool,
                   problem: Problem | None, rename: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip() or (skip_comments and line.lstrip().startswith("#")):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskDataError(f"{path}, line {lineno}: not valid JSON ({exc.msg})") from None
        record = renamed(record, rename, f"{path}, line {lineno}")
        check_record(record, required, f"{path}, line {lineno}", problem)
        records.append(record)
    return records


def renamed(record: Any, rename: Mapping[str, str] | None, where: str) -> Any:
    """``record`` with its hub columns renamed to the task's fields (``Task.hub_rename``); a record
    holding both a hub column and the field it becomes is refused at ``where``."""
    if not rename or not isinstance(record, dict):
        return record
    both = [f"{k!r} and {rename[k]!r}" for k in record if k in rename and rename[k] in record]
    if both:
        raise TaskDataError(f"{where}: fields {', '.join(both)} are the same field under its hub and its "
                            "own name; keep one")
    return {rename.get(k, k): v for k, v in record.items()}


def read_records(path: Path, required: Required, problem: Problem | None = None,
                 rename: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The records of a local data file: JSON lines, or one JSON array of objects, in the hub
    schema (``rename``: hub column -> the task's field, as for the hub itself).

    These are the layouts ``datasets.load_dataset("json", ...)`` reads (``.gz`` compressed
    too). Every record is checked (:func:`check_record`); an empty file, an empty array or any
    other JSON layout raises :class:`TaskDataError` naming the file, and a bad record the line
    (JSON lines) or the index (array) and the field.
    """
    text = _read_text(path)
    layout = f"JSON lines or a JSON array of objects with the fields {', '.join(required)}"
    if not text.strip():
        raise TaskDataError(f"{path}: the file is empty; expected {layout}")
    whole = _whole_json(text)
    if isinstance(whole, list):
        if not whole:
            raise TaskDataError(f"{path}: the JSON array holds no records; expected {layout}")
        records = [renamed(r, rename, f"{path}, record [{i}] of the JSON array") for i, r in enumerate(whole)]
        for i, record in enumerate(records):
            check_record(record, required, f"{path}, record [{i}] of the JSON array", problem)
        return records
    if isinstance(whole, dict) and "\n" in text.strip():
        raise TaskDataError(f"{path}: the file is one JSON object (keys {', '.join(map(str, whole))}); "
                            f"expected {layout}")
    return _jsonl_records(text.splitlines(), path, required, False, problem, rename)


def _whole_json(text: str) -> Any:
    """``text`` parsed as one JSON document, or None when it is not one (e.g. JSON lines)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def check_record(record: Any, required: Required, where: str, problem: Problem | None = None) -> None:
    """Raise :class:`TaskDataError` at ``where`` unless ``record`` has the ``required`` fields
    (with their types) and ``problem(record)`` finds nothing wrong."""
    if not isinstance(record, dict):
        raise TaskDataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key, kind in required.items():
        if key not in record:
            raise TaskDataError(f"{where}: missing field {key!r}")
        if not isinstance(record[key], kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            want = " or ".join(k.__name__ for k in kinds)
            raise TaskDataError(f"{where}: field {key!r} should be {want}, "
                                f"got {type(record[key]).__name__}")
    message = problem(record) if problem is not None else None
    if message:
        raise TaskDataError(f"{where}: {message}")


def data_paths(data_files: Sequence[str], key: str = "task.data_files") -> list[Path]:
    """The files ``data_files`` names (``~`` and glob patterns expanded), each an existing file."""
    paths: list[Path] = []
    for entry in data_files:
        name = str(Path(str(entry)).expanduser())
        if glob.has_magic(name):
            found = sorted(Path(p) for p in glob.glob(name, recursive=True) if Path(p).is_file())
            if not found:
                raise TaskDataError(f"{key}: the pattern {entry!r} matches no file")
            paths += found
        elif not Path(name).is_file():
            what = "is a directory" if Path(name).is_dir() else "does not exist"
            raise TaskDataError(f"{key}: {entry!r} {what}; give JSON-lines or JSON files (or a glob "
                                "such as data/*.jsonl)")
        else:
            paths.append(Path(name))
    return paths


#: values of ``task.prompt_format``
PROMPT_FORMATS = ("auto", "paper", "chat")


@dataclass
class TaskConfig:
    """Options shared by every task (the keys of ``conf/task/<name>.yaml`` besides ``name``).

    ``split`` defaults to the task's hub split; ``n_examples=None`` takes the whole pool;
    ``shuffle_seed=None`` keeps the file order; ``max_prompt_tokens`` keeps the prompt's last
    tokens; ``shots=None`` and ``stop=None`` take the prompt format's own; ``prompt_format`` is ``"auto"``,
    ``"paper"`` or ``"chat"`` (module docstring); ``use_chat_template`` (``paper`` format) is
    ``true``, ``false`` or ``"auto"`` (the task's choice for the paper prompt: HumanEval never,
    the others when the tokenizer has a template); the ``chat`` format always uses the template.
    """

    source: str = "offline"
    data_files: list[str] | None = None
    split: str | None = None
    n_examples: int | None = None
    shuffle_seed: int | None = 42
    shots: int | None = None
    max_new_tokens: int = 512
    max_prompt_tokens: int | None = None
    stop: list[str] | None = None
    prompt_format: str = "auto"
    use_chat_template: bool | str = "auto"

    def check(self, task: str) -> None:
        """Check every option (naming it as ``task.<option>=<value>``); a single string given for
        ``data_files`` or ``stop`` is read as a list of one."""
        key = "task.{}".format
        checks.choice(key("source"), self.source, ("offline", "hub", "local"))
        if isinstance(self.data_files, str):
            self.data_files = [self.data_files]
        if self.source == "local" and not self.data_files:
            raise checks.refuse(key("data_files"), self.data_files,
                                f"task.source=local needs data_files=<path.jsonl or .json> (task {task})")
        if self.source != "local" and self.data_files:
            raise checks.refuse(key("data_files"), self.data_files,
                                f"data files are read only with task.source=local, not {self.source}")
        for i, name in enumerate(self.data_files or []):
            checks.text(f"task.data_files[{i}]", name)
        checks.optional(checks.text, key("split"), self.split)
        if self.split is not None and self.source != "hub":
            raise checks.refuse(key("split"), self.split, f"a split is read only with task.source=hub, not "
                                f"{self.source}")
        checks.optional(checks.integer, key("n_examples"), self.n_examples, 1, why="null = the whole pool")
        checks.optional(checks.integer, key("shuffle_seed"), self.shuffle_seed, why="null = file order")
        checks.optional(checks.integer, key("shots"), self.shots, 0, why="null = the prompt format's own")
        checks.integer(key("max_new_tokens"), self.max_new_tokens, 1)
        checks.optional(checks.integer, key("max_prompt_tokens"), self.max_prompt_tokens, 1,
                        why="null = no limit")
        if self.stop is not None:
            self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
            for i, s in enumerate(self.stop):
                checks.text(f"task.stop[{i}]", s)
        checks.choice(key("prompt_format"), self.prompt_format, PROMPT_FORMATS,
                      why="auto: chat for a model with chat: true, else paper")
        checks.choice(key("use_chat_template"), self.use_chat_template, (True, False, "auto"))
        if self.prompt_format == "chat" and self.use_chat_template is False:
            raise checks.refuse(key("use_chat_template"), self.use_chat_template,
                                "task.prompt_format=chat is rendered with the chat template; use "
                                "task.prompt_format=paper for a raw prompt")


class Task:
    """Base class: loading, selection, rendering and the hooks each task fills in.

    Subclasses set ``name``, ``hub_id`` / ``hub_config`` / ``hub_split``, ``required`` (the
    fields a hub or local record must have, with their types), ``hub_rename`` (hub column ->
    field), ``defaults`` (their :class:`TaskConfig` values), ``config_class`` where they read
    keys of their own (a :class:`TaskConfig` subclass that checks them) and implement
    :meth:`offline_records`, :meth:`make_example` and :meth:`score` (and :meth:`check_scoring`
    where scoring needs something of the machine); for the ``chat`` prompt
    format they set ``chat_stop`` and may implement :meth:`chat_messages` and
    :meth:`extract_answer`. ``paper_stop`` / ``chat_stop`` are the stop strings of each format
    (``task.stop`` overrides both), ``paper_shots`` / ``chat_shots`` their exemplars (``task.shots``
    overrides both); ``paper_chat_template`` is what ``use_chat_template=auto``
    means for the paper prompt.
    """

    name: ClassVar[str]
    #: the task's title in tables and figures, and its quality metric as (key of :meth:`score`'s
    #: result, column title); None where the report shows no score (MT-Bench's judge is not run)
    title: ClassVar[str]
    score_column: ClassVar[tuple[str, str] | None] = None
    hub_id: ClassVar[str]
    #: the offline asset (:mod:`selfspec.store.assets`) :meth:`offline_records` reads
    asset: ClassVar[str]
    hub_config: ClassVar[str | None] = None
    hub_split: ClassVar[str] = "test"
    required: ClassVar[dict[str, type | tuple[type, ...]]]
    defaults: ClassVar[dict[str, Any]] = {}
    config_class: ClassVar[type[TaskConfig]] = TaskConfig
    hub_rename: ClassVar[dict[str, str]] = {}
    paper_shots: ClassVar[int] = 0
    chat_shots: ClassVar[int] = 0
    paper_stop: ClassVar[list[str]] = []
    chat_stop: ClassVar[list[str]] = []
    paper_chat_template: ClassVar[bool | str] = "auto"
    #: the record field that names an example (results are kept by it); a record without it is
    #: named by its place in the selection
    id_field: ClassVar[str] = "id"

    def __init__(self, model_chat: bool = False, **options: Any) -> None:
        """Options are the fields of ``config_class`` (:class:`TaskConfig`'s and the task's own);
        unset ones take the task's ``defaults``. ``model_chat``: the model config's ``chat`` key,
        which ``prompt_format=auto`` follows."""
        try:
            self.cfg = self.config_class(**{**self.defaults, **options})
        except TypeError as exc:
            known = ", ".join(self.config_class.__dataclass_fields__)
            raise ValueError(f"task {self.name}: {exc}; known options: {known}") from None
        self.cfg.check(self.name)
        self.model_chat = bool(model_chat)
        self._examples: list[Example] | None = None
        self._exemplars: list[dict[str, Any]] = []

    # -- prompt format -----------------------------------------------------------------
    @property
    def prompt_format(self) -> str:
        """``paper`` or ``chat``: ``task.prompt_format``, with ``auto`` resolved by the model's
        ``chat`` key (an explicit ``use_chat_template=false`` keeps the paper's raw prompt)."""
        if self.cfg.prompt_format != "auto":
            return self.cfg.prompt_format
        return "chat" if self.model_chat and self.cfg.use_chat_template is not False else "paper"

    @property
    def shots(self) -> int:
        """The exemplars per prompt: ``task.shots``, else the prompt format's own."""
        if self.cfg.shots is not None:
            return int(self.cfg.shots)
        return self.chat_shots if self.prompt_format == "chat" else self.paper_shots

    @property
    def stop(self) -> list[str]:
        """The stop strings in use: ``task.stop``, else the prompt format's own."""
        if self.cfg.stop is not None:
            return list(self.cfg.stop)
        return list(self.chat_stop if self.prompt_format == "chat" else self.paper_stop)

    def uses_chat_template(self, tokenizer: Any) -> bool:
        """Whether prompts go through ``tokenizer``'s chat template: always in the chat format;
        in the paper format per ``use_chat_template`` (``auto``: ``paper_chat_template``, whose
        ``auto`` is "when the tokenizer has one")."""
        if self.prompt_format == "chat":
            return True
        choice = self.cfg.use_chat_template
        if choice == "auto":
            choice = self.paper_chat_template
        if choice == "auto":
            return getattr(tokenizer, "chat_template", None) is not None
        return bool(choice)

    # -- hooks -------------------------------------------------------------------------
    def offline_records(self) -> list[dict[str, Any]]:
        """Records from the offline asset, in the hub schema."""
        raise NotImplementedError

    def make_example(self, record: dict[str, Any], index: int,
                     exemplars: list[dict[str, Any]]) -> Example:
        """One :class:`Example` from a record, with the shot records for its prompt (the paper's
        text prompt; :meth:`examples` adds the chat turns in the chat format)."""
        raise NotImplementedError

    def chat_messages(self, record: dict[str, Any], exemplars: list[dict[str, Any]],
                      example: Example) -> list[dict[str, str]]:
        """The chat format's turns for a record (default: the paper prompt as one user turn)."""
        return [{"role": "user", "content": example.prompt}]

    def extract_answer(self, text: str) -> str:
        """The chat format's answer as scored, from the text cut at the stop strings (default:
        stripped)."""
        return text.strip()

    def score(self, predictions: Sequence[Any], references: Sequence[Any]) -> dict[str, float]:
        """Metric values for post-processed ``predictions`` against example references."""
        raise NotImplementedError

    def check_scoring(self) -> None:
        """Refuse (:class:`~selfspec.config.checks.ConfigError`), before a model loads, a scoring this
        machine cannot do as configured; the evaluation runner calls it when it prepares a run
        (default: nothing to check)."""

    def score_samples(self, samples: Sequence[Sequence[Any]], references: Sequence[Any]) -> dict[str, Any]:
        """Metric values for one or more post-processed predictions per example (``n_samples``):
        by default :meth:`score` over every sample, each against its example's reference."""
        return self.score([p for s in samples for p in s],
                          [ref for s, ref in zip(samples, references) for _ in s])

    def sample_record(self, example_id: str, prediction: str) -> dict[str, Any] | None:
        """One line of the task's own samples file for a prediction (``None``: the task has none);
        the runner writes them to ``samples-<method>.jsonl``."""
        return None

    def postprocess(self, text: str) -> str:
        """The generation as scored: cut at the first stop string; in the chat format, then
        :meth:`extract_answer`."""
        text = cut_at(text, self.stop)
        return self.extract_answer(text) if self.prompt_format == "chat" else text

    # -- loading -----------------------------------------------------------------------
    @property
    def exemplars(self) -> list[dict[str, Any]]:
        """The in-context (shot) records, drawn from the shuffled pool before the examples."""
        self.examples()
        return self._exemplars

    def examples(self) -> list[Example]:
        """The selected examples (loaded once, then cached)."""
        if self._examples is None:
            pool = self._records()
            order = (np.arange(len(pool)) if self.cfg.shuffle_seed is None
                     else np.random.default_rng(self.cfg.shuffle_seed).permutation(len(pool)))
            pool = [pool[i] for i in order]
            shots = self.shots
            if shots >= len(pool):
                raise ValueError(f"task {self.name}: shots={shots} leaves no examples "
                                 f"from a pool of {len(pool)}")
            self._exemplars, rest = pool[:shots], pool[shots:]
            n = len(rest) if self.cfg.n_examples is None else self.cfg.n_examples
            if n > len(rest):
                warnings.warn(f"task {self.name}: n_examples={n} but only {len(rest)} are "
                              f"available after {shots} shot(s); using {len(rest)}",
                              stacklevel=2)
                n = len(rest)
            examples = [self._example(r, i) for i, r in enumerate(rest[:n])]
            self._check_unique(examples)
            self._examples = examples
        return self._examples

    def example_id(self, record: dict[str, Any], index: int) -> str:
        """The id of the example made of ``record``, the ``index``-th selected: its
        :attr:`id_field`, else its place."""
        return str(record.get(self.id_field, index))

    def _check_unique(self, examples: list[Example]) -> None:
        """Refuse a selection in which two examples share an id (issue 52: the runner keeps prompts,
        references and results by id, so one of them ran twice and the other never), naming where
        the records come from and the id."""
        counts = collections.Counter(ex.id for ex in examples)
        shared = next((i for i, n in counts.items() if n > 1), None)
        if shared is None:
            return
        where = (f"task.data_files={', '.join(map(str, self.cfg.data_files))}" if self.cfg.source == "local"
                 else f"task {self.name} (task.source={self.cfg.source})")
        raise TaskDataError(f"{where}: {counts[shared]} of the selected examples have the id {shared!r} (field "
                            f"'{self.id_field}'); results are kept by example id, so give each record its own "
                            f"'{self.id_field}' (a record without one is numbered by its place)")

    def _record_problem(self, record: dict[str, Any]) -> str | None:
        """:meth:`record_problem`, after a null id (issue 52: every record with ``"id": null`` became
        the example ``"None"``)."""
        if self.id_field in record and record[self.id_field] is None:
            return (f"field '{self.id_field}' is null: give the record its own id, or leave the field out (then "
                    "its place in the selection is its id)")
        return self.record_problem(record)

    def _example(self, record: dict[str, Any], index: int) -> Example:
        example = self.make_example(record, index, self._exemplars)
        example.meta["prompt_format"] = self.prompt_format
        if self.prompt_format == "chat":
            example.messages = self.chat_messages(record, self._exemplars, example)
        return example

    def record_problem(self, record: dict[str, Any]) -> str | None:
        """What is wrong with a record that has the ``required`` fields (default: nothing);
        checked as each record is read, so the message gets the file and line."""
        return None

    def _records(self) -> list[dict[str, Any]]:
        """The pool, every record checked (:func:`check_record`) where it is read."""
        if self.cfg.source == "local":
            return [r for path in data_paths(self.cfg.data_files)
                    for r in read_records(path, self.required, self._record_problem, self.hub_rename)]
        if self.cfg.source == "offline":
            records, where = self.offline_records(), f"offline asset of task {self.name}, record"
        else:
            import datasets

            split = self.cfg.split or self.hub_split
            ds = datasets.load_dataset(self.hub_id, self.hub_config, split=split)
            records = [{self.hub_rename.get(k, k): v for k, v in r.items()} for r in ds]
            self._hub_digest = hashlib.sha256(json.dumps(records, sort_keys=True, default=str).encode()).hexdigest()
            where = f"{self.hub_id} split {split}, row"
        for i, r in enumerate(records):
            check_record(r, self.required, f"{where} {i}", self._record_problem)
        return records

    def data_digests(self) -> dict[str, str]:
        """A content digest of everything the examples were read from, by where: the sha256 of each local
        data file (:func:`~selfspec.store.files.content_sha256`), the offline asset's pins, or the sha256 of
        the hub split's records as read. A run resumes only over the same digests (issue 68: an edited
        data file's old rows were kept and scored against its new references)."""
        from selfspec.store.assets import asset_digests
        from selfspec.store.files import content_sha256

        self.examples()
        if self.cfg.source == "local":
            return {str(p.resolve()): content_sha256(p) for p in data_paths(self.cfg.data_files)}
        if self.cfg.source == "offline":
            return asset_digests(self.asset)
        config = f"/{self.hub_config}" if self.hub_config else ""
        return {f"hub {self.hub_id}{config} split {self.cfg.split or self.hub_split}": self._hub_digest}

    def encode(self, example: Example, tokenizer: Any) -> list[int]:
        """Token ids of the rendered prompt, keeping the last ``max_prompt_tokens``.

        The chat template already carries the special tokens, so they are only added to
        raw prompts.
        """
        chat = self.uses_chat_template(tokenizer)
        if self.prompt_format == "chat" and getattr(tokenizer, "chat_template", None) is None:
            how = "task.prompt_format=chat" if self.cfg.prompt_format == "chat" else \
                "task.prompt_format=auto with model.chat=true"
            raise ValueError(f"task {self.name}: {how} renders chat turns, but the model's tokenizer has no "
                             "chat template; set task.prompt_format=paper")
        text = render(example, tokenizer, chat)
        ids = tokenizer(text, add_special_tokens=not chat)["input_ids"]
        if self.cfg.max_prompt_tokens is not None and len(ids) > self.cfg.max_prompt_tokens:
            ids = ids[-self.cfg.max_prompt_tokens:]
        return list(ids)

    def __len__(self) -> int:
        return len(self.examples())

    def __iter__(self) -> Iterator[Example]:
        return iter(self.examples())


def cut_at(text: str, stops: Iterable[str]) -> str:
    """``text`` up to the earliest occurrence of any stop string."""
    end = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:end]


def render(example: Example, tokenizer: Any = None, use_chat_template: bool | str = "auto",
           system_prompt: str | None = None) -> str:
    """The text the model reads: the raw prompt, or the chat template applied to it.

    ``use_chat_template="auto"`` applies the template when ``tokenizer`` has one (instruct
    models); the prompt becomes one user turn followed by the generation prompt. An example in
    the chat format (``example.messages``) is its turns through the template, always.
    """
    if example.messages is not None:
        if use_chat_template is False:
            raise ValueError(f"example {example.id} is in the chat prompt format; it is rendered with "
                             "the chat template (task.prompt_format=paper gives a raw prompt)")
        use_chat_template = True
    if use_chat_template == "auto":
        use_chat_template = getattr(tokenizer, "chat_template", None) is not None
    if not use_chat_template:
        return example.prompt
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("use_chat_template=true (or task.prompt_format=chat) needs a tokenizer with a "
                         "chat template")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages += example.messages or [{"role": "user", "content": example.prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
