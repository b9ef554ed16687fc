"""`hf://` paths that huggingface_hub's own `hf://` form reads as a repo type (`hf://datasets/ORG/NAME`,
`hf://models/ORG/NAME`, `hf://datasets/NAME`) and revisions it percent-encodes (`@refs%2Fpr%2F1`).

Before, the strict URL check suggested `hf://datasets/ORG` for `hf://datasets/ORG/NAME` (a model repo in
the namespace `datasets`) and `hf://models/ORG` for the model repo `hf://models/ORG/NAME`; a dataset's short
form `hf://datasets/NAME` was taken for the model repo `datasets/NAME`; and `@exp%2Fa` made a branch named
`exp%2Fa`, which `restore hf://ORG/REPO@exp%2Fa` then could not find.
"""

from __future__ import annotations

import pytest

from stagerd.errors import ConfigError
from stagerd.sinks.hub.url import parse_hub_url
from stagerd.sinks.urls import parse_sink_url
from tests.sinks.hub.hub_helpers import REPO, make_sink


@pytest.mark.parametrize("url", ["hf://datasets/acme/llm", "hf://datasets/squad", "hf://spaces/acme/demo"])
@pytest.mark.parametrize("parse", [parse_sink_url, parse_hub_url])
def test_a_path_under_a_repo_type_is_refused_and_no_repo_of_that_namespace_suggested(parse, url):
    kind = url.split("/")[2]
    with pytest.raises(ConfigError, match=f"model repos only, not {kind}") as info:
        parse(url)
    assert f"hf://{kind}/" not in (info.value.hint or "")


@pytest.mark.parametrize("parse", [parse_sink_url, parse_hub_url])
def test_a_model_repo_written_with_models_is_refused_with_its_url(parse):
    with pytest.raises(ConfigError, match="without models/") as info:
        parse("hf://models/acme/llm@exp-a?private=false")
    assert "hf://acme/llm" in (info.value.hint or "") and "hf://models" not in (info.value.hint or "")


def test_a_percent_encoded_revision_is_refused_before_any_request(hub):
    with pytest.raises(ConfigError, match="percent-encoded") as info:
        make_sink(hub, f"hf://{REPO}@exp%2Fa")
    assert f"hf://{REPO}@exp/a" in (info.value.hint or "")
    assert not hub.stats.requests
    assert parse_hub_url(f"hf://{REPO}@50%off").revision == "50%off"  # a % that encodes nothing is a name
