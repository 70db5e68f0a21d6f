"""A sample Code node: greets the state's name and counts its items."""

from datetime import UTC, datetime


def main(state):
    print(f"greeting {state.get('name', 'world')}")  # kept as logs, never the output
    return {
        "greeting": f"Hello, {state.get('name', 'world')}!",
        "items": len(state.get("items", [])),
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
