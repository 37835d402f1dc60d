"""The gRPC API (proto/pagoda/v1/inference.proto), the standard health service and reflection, over
the same engine client as HTTP."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError

from pagoda.service.api.api_keys import APIKeys
from pagoda.service.api.engine_client import APIError, EngineClient, ServingState
from pagoda.service.api.structured_output import grammar_from_proto
from pagoda.service.api.tool_calls import (
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCallStream,
    ToolChoice,
    ToolDefinition,
    ToolPlan,
    call_dict,
    parse_calls,
    plan_tools,
)
from pagoda.service.errors import InvalidRequestError
from pagoda.service.grpc_gen import inference_pb2 as pb
from pagoda.service.grpc_gen import inference_pb2_grpc as pb_grpc
from pagoda.service.outputs import Logprob
from pagoda.service.sampling_params import SamplingParams

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
GRPC_CODES: dict[str, grpc.StatusCode] = {
    "invalid_request": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "queue_full": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "internal": grpc.StatusCode.INTERNAL,
}
FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
SERVING_STATES = {
    ServingState.LOADING: pb.SERVING_STATE_LOADING,
    ServingState.READY: pb.SERVING_STATE_READY,
    ServingState.DRAINING: pb.SERVING_STATE_DRAINING,
    ServingState.UNHEALTHY: pb.SERVING_STATE_UNHEALTHY,
    ServingState.STALLED: pb.SERVING_STATE_UNHEALTHY,
}


def sampling_params(msg: pb.SamplingParameters) -> SamplingParams:
    return SamplingParams(
        n=msg.n or 1,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        max_tokens=msg.max_new_tokens or 16,
        min_tokens=msg.min_new_tokens,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.top_logprobs if msg.HasField("top_logprobs") else None,
        grammar=grammar_from_proto(msg),
        logit_bias=dict(msg.logit_bias) or None,
        allowed_token_ids=list(msg.allowed_token_ids) or None,
        truncate_prompt_tokens=msg.truncate_prompt_tokens if msg.HasField("truncate_prompt_tokens") else None,
        include_stop_str_in_output=msg.include_stop_str_in_output,
    )


def _chat_message(m: pb.ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        message["tool_calls"] = [
            call_dict(c.name, c.arguments_json or "{}", c.id or None) for c in m.tool_calls
        ]
    return message


def _tool_plan(chat: pb.ChatMessages) -> ToolPlan:
    """The plan of a gRPC chat's tools, through the same checks as HTTP's."""
    tools = []
    for i, tool in enumerate(chat.tools):
        try:
            parameters = json.loads(tool.parameters_json) if tool.parameters_json else None
            definition = ToolDefinition(
                function=FunctionDefinition(
                    name=tool.name, description=tool.description or None, parameters=parameters
                )
            )
        except (ValueError, ValidationError) as exc:
            raise InvalidRequestError(f"tools[{i}] is not a valid tool: {exc}", f"tools.{i}") from exc
        tools.append(definition)
    name = chat.tool_choice
    choice: ToolChoice | None = None
    if name in ("none", "auto", "required"):
        choice = name  # type: ignore[assignment]
    elif name:
        choice = NamedToolChoice(function=NamedFunction(name=name))
    return plan_tools(tools or None, choice)


def _token_logprob(token_id: int, token: str, logprob: float) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=token_id, token=token, logprob=logprob)


def _logprobs(logprobs: list[Logprob] | None) -> list[pb.GeneratedTokenLogprob]:
    return [
        pb.GeneratedTokenLogprob(
            token=_token_logprob(lp.token_id, lp.token, lp.logprob),
            top_logprobs=[_token_logprob(t.token_id, t.token, t.logprob) for t in lp.top],
        )
        for lp in logprobs or []
    ]


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def _prompt(self, request: pb.GenerateRequest, plan: ToolPlan) -> str | list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return request.text
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "chat":
            messages = [_chat_message(m) for m in request.chat.messages]
            return await self.client.render_chat(messages, tools=plan.template_tools)
        raise InvalidRequestError("one of text, token_ids or chat must be set", "prompt")

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            lora = self.client.check_model(request.model)  # a LoRA adapter's name, as over HTTP
            self.client.admit().release()  # refused before the prompt is rendered; generate admits it
            try:
                plan = (
                    _tool_plan(request.chat) if request.WhichOneof("prompt") == "chat" else ToolPlan("none")
                )
                params = sampling_params(request.sampling)  # checked before the prompt is rendered
                prompt = await self._prompt(request, plan)
                if plan.grammar is not None:
                    if params.grammar is not None:
                        raise InvalidRequestError(
                            f"{params.grammar.param} cannot be combined with tool_choice {plan.mode}",
                            "tool_choice",
                        )
                    params.grammar = plan.grammar
            except InvalidRequestError as exc:
                self.client.metrics.count_error("invalid_request")
                raise APIError("invalid_request", str(exc), param=exc.param) from exc
            stream = self.client.generate(prompt, params, request.request_id or None, lora_name=lora)
            try:
                last: Any = None
                done: set[int] = set()
                # With tools, a call's text is held back from `text` and comes parsed at the end.
                parser = self.client.tool_parser if plan.mode != "none" else None
                tool_streams: dict[int, ToolCallStream] = {}
                async for out in stream:
                    last = out
                    for c in out.outputs:
                        finish = c.finish_reason if c.index not in done else None
                        if not (c.text_delta or c.token_ids_delta or finish):
                            continue
                        if finish:
                            done.add(c.index)
                        text, calls = c.text_delta, []
                        if plan.mode != "none":
                            tools = tool_streams.setdefault(c.index, ToolCallStream(plan, parser))
                            text = "".join(d.get("content", "") for d in tools.feed(c.text_delta))
                            if finish:
                                tail, _ = tools.finish()
                                text += "".join(d.get("content", "") for d in tail)
                                calls = parse_calls(tools.text, plan, parser)[1]
                        reason = FINISH_REASONS[finish] if finish else pb.FINISH_REASON_UNSPECIFIED
                        if calls and finish == "stop":
                            reason = pb.FINISH_REASON_TOOL_CALLS
                        yield pb.GenerateResponse(
                            request_id=out.request_id,
                            index=c.index,
                            text=text,
                            token_ids=c.token_ids_delta,
                            logprobs=_logprobs(c.logprobs_delta),
                            finish_reason=reason,
                            stop_string=c.stop_reason if isinstance(c.stop_reason, str) else "",
                            tool_calls=[
                                pb.ToolCall(
                                    id=call["id"],
                                    name=call["function"]["name"],
                                    arguments_json=call["function"]["arguments"],
                                )
                                for call in calls
                            ],
                        )
                if last is not None:
                    timing = last.metrics
                    ttft = (timing.first_token_time or timing.arrival_time) - timing.arrival_time
                    yield pb.GenerateResponse(
                        request_id=last.request_id,
                        usage=pb.Usage(
                            prompt_tokens=len(last.prompt_token_ids),
                            completion_tokens=sum(len(c.token_ids) for c in last.outputs),
                            cached_prompt_tokens=timing.num_cached_tokens,
                        ),
                        time_to_first_token_seconds=ttft,
                    )
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
        except APIError as exc:
            await context.abort(GRPC_CODES[exc.kind], exc.message)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        try:
            stats = self.client.stats()
            return pb.GetModelInfoResponse(
                model_name=self.client.model_name,
                max_context_length_tokens=self.client.max_model_len,
                kv_block_size_tokens=stats.block_size,
                num_kv_blocks=stats.num_kv_blocks,
                eos_token_ids=self.client.eos_token_ids,
            )
        except APIError as exc:
            await context.abort(GRPC_CODES[exc.kind], exc.message)
            raise  # unreachable: abort raises

    async def GetReadiness(
        self, request: pb.GetReadinessRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetReadinessResponse:
        state = self.client.state
        stats = self.client.stats_or_none()
        return pb.GetReadinessResponse(
            ready=state is ServingState.READY,
            state=SERVING_STATES[state],
            num_requests_waiting=stats.num_waiting if stats else 0,
            num_requests_running=stats.num_running if stats else 0,
        )


class APIKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless the `authorization` metadata is `Bearer <key>` with one of `keys`; the
    health service and reflection stay open, as HTTP's probes do."""

    OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = APIKeys(keys)

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        for name, value in metadata or ():
            if name == "authorization":
                return self.keys.accept(value)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method  # type: ignore[attr-defined]
        if handler is None or method.startswith(self.OPEN_PREFIXES):
            return handler
        if self.authorized(details.invocation_metadata):  # type: ignore[attr-defined]
            return handler
        message = "missing or incorrect API key: send `authorization: Bearer <key>` metadata"

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - abort raises

        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
        return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


class GrpcServer:
    """The grpc.aio server with Inference, grpc.health.v1.Health and reflection."""

    def __init__(self, client: EngineClient, host: str, port: int, api_keys: Sequence[str] = ()) -> None:
        interceptors = [APIKeyInterceptor(api_keys)] if api_keys else []
        self.server = grpc.aio.server(interceptors=interceptors)
        pb_grpc.add_InferenceServicer_to_server(InferenceServicer(client), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            self.server,
        )
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = self.server.add_insecure_port(address)

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()

    async def set_serving(self, is_serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if is_serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)
