"""The function tools the Messages and Responses tool tests offer the default model, with the
models their arguments must validate against. Strings are bounded, so that a constrained call
ends well within the tests' token budgets."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field


class WeatherArgs(BaseModel):
    city: Annotated[str, Field(max_length=24)]
    unit: Literal["celsius", "fahrenheit"]


class TimeArgs(BaseModel):
    timezone: Annotated[str, Field(pattern=r"^[A-Z][a-z]{1,12}/[A-Z][a-z]{1,12}$")]


ARGS: dict[str, type[BaseModel]] = {"get_weather": WeatherArgs, "get_time": TimeArgs}
"""Each tool's name and the model of its arguments."""

DESCRIPTIONS = {
    "get_weather": "The current weather in a city.",
    "get_time": "The current time in a timezone.",
}
