"""Run by tests/test_python_agents.py with instructor's own venv (tests/clients/instructor.txt):
asks the server at URL for a Trip in instructor's MODE and prints it as JSON."""

import sys
from typing import Literal

import instructor
from openai import OpenAI
from pydantic import BaseModel, ConfigDict


class Trip(BaseModel):
    """Every value bounded: with other keys allowed, a random model may write one forever."""

    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Rome"]
    days: Literal[1, 2, 3]


def main(url: str, mode: str) -> None:
    client = OpenAI(base_url=url, api_key="-", max_retries=0, timeout=60)
    client = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    ask = dict(model="local", response_model=Trip, max_retries=0, temperature=0)
    if mode == "RESPONSES_TOOLS":
        trip = client.responses.create(**ask, max_output_tokens=64, input="Plan a short trip.")
    else:
        messages = [{"role": "user", "content": "Plan a short trip."}]
        trip = client.chat.completions.create(**ask, max_tokens=64, messages=messages)
    print(trip.model_dump_json())


if __name__ == "__main__":
    main(*sys.argv[1:])
