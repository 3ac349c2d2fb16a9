"""Talk to a running vLLM server over its OpenAI-compatible HTTP API (stdlib only), and judge what it says.
`top1_agreement` is teacher-forced on the baseline's tokens, so one early near-tie does not turn every later token
into a disagreement, and a degenerate FP8 server cannot agree with its own repetition."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcalib.core.errors import ServerError

__all__ = ["Completion", "DEATH_GRACE_S", "REQUEST_TIMEOUT_S", "ServerClient", "degenerate"]

REQUEST_TIMEOUT_S = 600.0
DEATH_GRACE_S = 5.0


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]


class ServerClient:
    """A vLLM server at `base_url` serving `model`; `exit_code()` says if its process has exited."""

    def __init__(
        self,
        base_url: str,
        model: str,
        exit_code: Callable[[], int | None],
        log: str | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.base_url, self.model, self.exit_code = base_url.rstrip("/"), model, exit_code
        self.log, self.timeout_s = log, timeout_s

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps({"model": self.model, **body}).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise ServerError(
                f"the server answered {path} with HTTP {err.code}: {detail}",
                hint="see the server log",
                log=self.log,
            ) from None
        except (
            urllib.error.URLError,
            http.client.HTTPException,
            ConnectionError,
            TimeoutError,
        ) as err:
            raise self._lost(path, err) from None
        except json.JSONDecodeError:
            raise ServerError(f"the server's answer to {path} is not JSON", log=self.log) from None

    def _lost(self, path: str, err: Exception) -> ServerError:
        deadline = (
            time.monotonic() + DEATH_GRACE_S
        )  # a dropped connection often means a process on its way out
        while (code := self.exit_code()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if code is not None:
            return ServerError(
                f"the vLLM server exited (code {code}) while answering {path}",
                hint="see the log tail above for why",
                log=self.log,
            )
        return ServerError(
            f"the vLLM server stopped answering {path} ({err})",
            hint="the server is still running but did not answer in time; see its log",
            log=self.log,
        )

    def _completion(
        self, prompt: str | Sequence[int], max_tokens: int, **more: Any
    ) -> dict[str, Any]:
        """The first choice of the greedy completion of `prompt` (text or token ids)."""
        answer = self._post(
            "/v1/completions",
            {
                "prompt": prompt if isinstance(prompt, str) else list(prompt),
                "max_tokens": max_tokens,
                "temperature": 0,
                **more,
                "return_token_ids": True,
            },
        )
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ServerError("the server's completion has no choices", log=self.log)
        return choices[0]

    def complete(self, prompt: str | Sequence[int], max_tokens: int) -> Completion:
        choice = self._completion(prompt, max_tokens)
        return Completion(
            str(choice.get("text") or ""),
            tuple(choice.get("token_ids") or ()),
            tuple(choice.get("prompt_token_ids") or ()),
        )

    def _prompt_logprobs(
        self, prompt: str | Sequence[int], top: int
    ) -> tuple[list[Any], list[int]]:
        choice = self._completion(prompt, 1, prompt_logprobs=top)
        logprobs, ids = choice.get("prompt_logprobs"), choice.get("prompt_token_ids")
        if not isinstance(logprobs, list) or not isinstance(ids, list) or len(logprobs) != len(ids):
            raise ServerError(
                "the server returned no prompt log-probs (prompt_logprobs / prompt_token_ids)",
                hint="serve-check needs a vLLM whose completions API takes prompt_logprobs and "
                "return_token_ids",
                log=self.log,
            )
        return logprobs, ids

    def token_nlls(self, text: str) -> tuple[float, ...]:
        """The negative log-likelihood (nats) of each token of `text` after its first."""
        logprobs, ids = self._prompt_logprobs(text, 0)
        values = tuple(-_entry(logprobs[i], ids[i])["logprob"] for i in range(1, len(ids)))
        if not values:
            raise ServerError("the NLL text is a single token", log=self.log)
        return values

    def top1_agreement(
        self, prompt_ids: Sequence[int], continuation_ids: Sequence[int]
    ) -> float | None:
        """Share of `continuation_ids` this server ranks first, given the same prefix (None if empty)."""
        if not continuation_ids:
            return None
        logprobs, _ = self._prompt_logprobs(list(prompt_ids) + list(continuation_ids), 1)
        start = len(prompt_ids)
        ranks = [
            _entry(logprobs[start + j], token).get("rank")
            for j, token in enumerate(continuation_ids)
        ]
        return sum(1 for rank in ranks if rank == 1) / len(ranks)


def _entry(position: Any, token: int) -> dict[str, Any]:
    """The log-prob entry for `token` at one prompt position ({token_id: {"logprob", "rank", ...}})."""
    entry = position.get(str(token)) if isinstance(position, dict) else None
    if not isinstance(entry, dict) or not isinstance(entry.get("logprob"), (int, float)):
        raise ServerError(f"prompt log-probs lack an entry for token {token}")
    return entry


def degenerate(text: str, token_ids: Sequence[int]) -> str | None:
    """Why an output is degenerate (empty, or a token or two repeated), or None if it is not."""
    if not text.strip():
        return "empty output"
    n = len(token_ids)
    if n >= 8:
        distinct = len(set(token_ids))
        if distinct <= max(1, n // 8):
            return f"{n} tokens but only {distinct} distinct"
    return None
