"""The demo page in headless Chromium: a fake microphone speaks, the page hears the answer.

Debian's chromium (apt; `.ci/run` installs it) driven by Playwright with an explicit
`executable_path`: Playwright's own browser downloads cannot work here. The page's observable
state is `window.omni` (see web/page.js).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import ConsoleMessage, Page, sync_playwright

from tests.conftest import timeout

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium_flags(mic_wav: Path) -> list[str]:
    return [
        "--no-sandbox",  # CI runs as root
        "--autoplay-policy=no-user-gesture-required",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={mic_wav}",
        "--allow-loopback-in-peer-connection",
        "--disable-features=WebRtcHideLocalIpsWithMdns",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
    ]


def omni(page: Page) -> Any:
    return page.evaluate("window.omni")


def test_demo_page_calls_hears_and_hangs_up(server: str, mic_wav: Path, tmp_path: Path) -> None:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run does)")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=chromium_flags(mic_wav)
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page_errors: list[str] = []
            page.on("pageerror", lambda e: page_errors.append(str(e)))

            def on_console(message: ConsoleMessage) -> None:
                # A module that fails to load (a 404, a wrong MIME type) is only a console error.
                if message.type == "error":
                    page_errors.append(f"console: {message.text}")

            page.on("console", on_console)
            page.goto(server)
            assert page.evaluate("'omni' in window"), f"the page did not start: {page_errors}"
            page.select_option("#voice", "ethan")  # sent as session.update once connected

            page.click("#connect")
            page.wait_for_function(
                "window.omni.connected && window.omni.channelOpen", timeout=timeout(15) * 1000
            )
            # Short answers keep the test quick: the simulated thinker makes 32 tokens otherwise.
            page.evaluate(
                """window.omni.send({type: "session.update",
                    session: {type: "realtime", max_output_tokens: 8}})"""
            )
            page.wait_for_function(
                "(window.omni.events['response.done'] || 0) >= 1 && window.omni.rx.maxPeak > 0.01"
                " && window.omni.rx.packets > 0",
                timeout=timeout(30) * 1000,
            )
            state = omni(page)
            shot = tmp_path / "demo-page.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")

            seen = state["events"]
            for kind in (
                "session.created",
                "session.updated",
                "input_audio_buffer.speech_started",
                "input_audio_buffer.speech_stopped",
                "response.created",
                "response.done",
            ):
                assert seen.get(kind), f"{kind} never arrived; seen: {sorted(seen)}"
            assert page.input_value("#voice") == "ethan"  # as the server's session.updated says
            assert page.is_checked("#semantic")  # the server took semantic_vad: Smart Turn's
            assert state["rx"]["bytes"] > 0
            assert state["latency"]["firstAudioMs"], "no first-audio latency was measured"
            assert page.locator("#transcript .msg.you").count() >= 1
            assert page.locator("#transcript .msg.bot").count() >= 1
            assert state["errors"] == [], state["errors"]
            assert page_errors == [], page_errors

            # Hang up in push-to-talk with Space held again just after a release (whose turn
            # waits 200 ms to be committed), and with the camera switched on mid-call: it joins
            # the next call, and the page says so until then.
            page.click("label:has(#camera)")
            page.wait_for_selector("#camera-hint", state="visible")
            page.click("label:has(#vad)")  # off: push-to-talk
            you_bubbles = page.locator("#transcript .msg.you").count()
            held = page.evaluate(
                """() => {
                    document.activeElement.blur();  // Space in a form field is typing
                    const space = (type) => dispatchEvent(new KeyboardEvent(type, {code: "Space"}));
                    space("keydown");
                    space("keyup");
                    space("keydown");
                    const held = document.getElementById("ptt").classList.contains("active");
                    document.getElementById("connect").click();  // now "Hang up"
                    space("keyup");
                    return held;
                }"""
            )
            assert held, "Space did not press push-to-talk"
            assert omni(page)["state"] == "closed"
            assert page.text_content("#connect") == "Connect"
            page.wait_for_timeout(timeout(0.4) * 1000)  # past the released turn's commit delay
            assert "active" not in (page.get_attribute("#ptt", "class") or "")
            assert page.locator("#transcript .msg.you").count() == you_bubbles

            page.click("#connect")
            page.wait_for_function("window.omni.connected", timeout=timeout(15) * 1000)
            assert page.locator("#camera-hint").is_hidden()
            page.click("#connect")
            page.wait_for_function("window.omni.state === 'closed'", timeout=timeout(5) * 1000)
            assert omni(page)["errors"] == [], omni(page)["errors"]
            assert page_errors == [], page_errors
        finally:
            browser.close()
