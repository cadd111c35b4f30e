"""A request body, read and parsed by the server itself: its size checked before it is
read (the declared length) and while it is read (a chunked body), then parsed and
validated by pydantic's JSON parser, which refuses invalid UTF-8, lone surrogates and
nesting past its limit. Every refusal is a ``BadRequest`` with one line."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

DEFAULT_MAX_BODY_BYTES = 4 << 20  # a 128k-token prompt as text is ~0.5 MB; ids ~0.8 MB

Model = TypeVar("Model", bound=BaseModel)


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def _too_large(size: str, limit: int) -> BadRequest:
    return BadRequest(
        f"the request body is {size} bytes, the server accepts at most {limit:,} "
        "(deinfer serve --max-body-bytes)",
        status=413,
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or a 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared):,}", limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(f"more than {limit:,}", limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise BadRequest("the client closed the connection while sending", status=499) from None
    return b"".join(chunks)


_BRANCHES = ("str", "int", "float", "bool")


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """The first error as one line, and the field it names."""
    first = exc.errors()[0]
    message = str(first["msg"]).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {message.removeprefix('Invalid JSON: ')}", None
    where = [str(p) for p in first.get("loc", ())]
    # a union's branch names (``stop.list[str]``) say nothing to a client
    where = [p for p in where if p not in _BRANCHES and not p.startswith(("list[", "dict["))]
    field = ".".join(where)
    text = f"{field}: {message}" if field else message
    return " ".join(text.split()), where[0] if where else None


def parse(model: type[Model], body: bytes) -> Model:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise BadRequest(message, param=param) from None
