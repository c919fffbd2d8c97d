"""The README's tool-calling session: `k3 serve` (default model k3-chat) on port 8000, then
python3 tools/k3chat/session.py  (needs the openai package)."""
import json, openai
client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
UNIT = {"type": "string", "description": "Unit symbol: km, mi, m, ft, cm, in, kg, lb, g, oz, l, gal, ml, C, F or K."}
tools = [{"type": "function", "function": {"name": "convert_units", "description": "Convert a value from one unit to another.",
          "parameters": {"type": "object", "properties": {"value": {"type": "number", "description": "The amount to convert."},
                         "from": UNIT, "to": UNIT}, "required": ["value", "from", "to"]}}}]
messages = [{"role": "user", "content": "How many km is 26.2 miles?"}]
r = client.chat.completions.create(model="k3-chat", messages=messages, tools=tools, temperature=0)
m = r.choices[0].message
print("finish_reason:", r.choices[0].finish_reason)
print("reasoning_content:", repr(m.reasoning_content) if hasattr(m, "reasoning_content") else None)
print("content:", repr(m.content))
print("tool_calls:", [(c.function.name, c.function.arguments) for c in m.tool_calls])
call = m.tool_calls[0]
args = json.loads(call.function.arguments)
result = f"{args['value'] * 1.609344:.2f}"
messages += [{"role": "assistant", "content": m.content or "", "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": result}]
print("tool result sent:", result)
parts = []
for chunk in client.chat.completions.create(model="k3-chat", messages=messages, tools=tools, temperature=0, stream=True):
    for ch in chunk.choices:
        parts.append(ch.delta.content or "")
print("streamed answer:", repr("".join(parts)))
