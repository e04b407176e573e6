"""`/readyz`, `/v1/stats` and `/metrics` of a pipeline that lost a replica but serves: ready
(a load balancer keeps the gateway in rotation), with the lost process named as down."""

from __future__ import annotations

import json

from tests.unit.gateway.app_harness import bearer, gateway_server

KEY = "sk-test"


def test_a_degraded_pipeline_is_ready_and_names_what_is_down() -> None:
    with gateway_server(keys=KEY) as srv:
        coord = srv.gw.coord
        coord.degraded = {"talker_ar#1": "down, restarting"}  # type: ignore[union-attr]
        coord.epochs = {"talker_ar#0": 0, "talker_ar#1": 3}  # type: ignore[union-attr]
        status, _, body = srv.request("GET", "/readyz", None, bearer(KEY))
        assert status == 200
        assert json.loads(body) == {
            "ready": True,
            "draining": False,
            "degraded": True,
            "down": {"talker_ar#1": "down, restarting"},
        }
        status, _, body = srv.request("GET", "/v1/stats", None, bearer(KEY))
        assert status == 200 and json.loads(body)["down"] == {"talker_ar#1": "down, restarting"}
        status, _, body = srv.request("GET", "/metrics", None, bearer(KEY))
        assert status == 200
        assert 'rto_process_up{process="talker_ar#1"} 0.0' in body.decode()
        assert 'rto_process_up{process="talker_ar#0"} 1.0' in body.decode()
        coord.ready = False  # type: ignore[union-attr]  # no replica of a stage left
        assert srv.request("GET", "/readyz", None, bearer(KEY))[0] == 503
