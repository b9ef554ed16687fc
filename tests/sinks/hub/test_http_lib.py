"""The Hub sink's HTTP library is the one huggingface_hub sends with (httpx2 from 2.0, httpx before): the
errors it classifies and the client it hooks are that library's. Run beside huggingface_hub 1.x as well
(RELIABILITY.md, "Dependency floors")."""

from __future__ import annotations


def test_the_library_is_the_one_huggingface_hub_sends_with():
    from huggingface_hub.utils import get_session

    from stagerd.sinks.hub.http_lib import httpx

    session = get_session()
    assert isinstance(session, httpx.Client)
    assert type(session).__module__.split(".")[0] == httpx.__name__
