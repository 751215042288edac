"""CNN/DailyMail 3.0.0 (See et al. 2017): multi-sentence highlights of news articles.

Offline: the 150 articles with reference highlights of BIG-bench's ``factuality_of_summary``
task (asset ``cnndm``; JSON lines after ``#`` comment lines, ``source`` = article,
``true_cnd`` = highlights, ``idx`` = id), mapped to the hub schema.
"""

from __future__ import annotations

from typing import Any

from selfspec.store.assets import asset_path
from selfspec.tasks.summarization import SummarisationTask
from selfspec.tasks.task import read_jsonl


class CnnDm(SummarisationTask):
    name = "cnndm"
    title = "CNN/DM"
    score_column = ("rouge2", "ROUGE-2")
    hub_id = "abisee/cnn_dailymail"
    asset = "cnndm"
    hub_config = "3.0.0"
    document_field = "article"
    summary_field = "highlights"
    instruction = "Summarize the article above in three short sentences."
    required = {"article": str, "highlights": str}

    def offline_records(self) -> list[dict[str, Any]]:
        rows = read_jsonl(asset_path(self.asset), {"source": str, "true_cnd": str},
                          skip_comments=True)
        return [{"id": r.get("idx", str(i)), "article": r["source"], "highlights": r["true_cnd"]}
                for i, r in enumerate(rows)]
