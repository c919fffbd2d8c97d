"""The synthetic chat tasks: tool declarations, the tools' implementations, and a generator of
conversations (OpenAI chat requests) deterministic by seed.

gen_data.py renders them for training; eval.py uses the same tools (executing the model's own
arguments) and the held-out episodes. Everything is printable ASCII (render.py checks).

Kinds of exchange (one user turn and the assistant's reply, with tool calls and results):
  call      a declared tool is needed: think, call it with arguments copied from the question,
            read the tool result, answer with it (calculator, convert_units, lookup, get_weather,
            send_email, set_timer; sometimes two calls at once)
  refuse    the request needs a tool that is not declared (or that no tool offers): a polite
            refusal in content, naming what is available
  direct    answerable from the prompt: a table given in the system prompt, "repeat after me",
            the day/month after or before another
  chat      greetings, thanks, who are you, what can you do (lists the declared tools)
"""
import ast
import json
import operator
import random
import zlib

# ---------------------------------------------------------------------------------------------
# vocabularies; the "heldout" pools appear only in the held-out split (copying, not memorising)

FIRST = ("Ana Ben Carla David Elena Farid Grace Hugo Ines Jonas Kira Leo Maya Nadia Omar Paula Quinn Rosa "
         "Samir Tara Umar Vera Walter Xenia Yusuf Zoe Aaron Bianca Cyril Daria Emil Fatima Gustav Hana Ivan "
         "Julia Karim Lena Marco Nina Oscar Priya Rafael Sofia Tomas Ursula Viktor Wendy Yara Zane").split()
FIRST_HELD = "Aylin Bruno Chiara Dmitri Esme Florin Greta Hamid Ilse Jasper Keiko Lucian Mirela Nils Olga".split()
LAST = ("Silva Moreau Novak Tanaka Berg Costa Meyer Rossi Khan Larsen Dubois Weber Kowalski Nagy Haddad "
        "Ortiz Petrov Santos Fischer Lindqvist Okafor Rahman Yilmaz Brandt Castillo Duarte Eriksen Fontaine "
        "Grant Holm Ivanova Jensen Keller Lopez Marsh Nolan").split()
LAST_HELD = "Abbott Baranov Cardenas Delacroix Engel Falk Gallo Hartmann Iqbal Jovanovic".split()
CITIES = ("Oslo Lisbon Nairobi Lima Osaka Dublin Porto Quito Riga Seoul Tunis Vienna Warsaw Zagreb Accra "
          "Bergen Cairo Denver Geneva Hanoi Izmir Jakarta Kyoto Lagos Madrid Nantes Ottawa Perth Rabat Sofia "
          "Toronto Utrecht Valencia Wellington Bogota Chicago Dakar Helsinki Manila Santiago").split()
CITIES_HELD = "Aarhus Bilbao Cusco Durban Fukuoka Galway Hobart Krakow Leipzig Malmo".split()
# syllables of made-up names: half the names, cities and products of the TRAINING split are made
# up, so the model must copy them from the request (the pools alone taught it to recall a
# familiar name instead: 20 % argument accuracy on held-out e-mail addresses)
SYLLABLES = ("ba be bi bo bu da de di do ka ke ki ko ku la le li lo lu ma me mi mo mu na ne ni no nu "
             "ra re ri ro ru sa se si so su ta te ti to tu va ve vi vo za zo an el in or us ar en on").split()
ADJ = "blue red green small large steel glass wooden silver black white compact folding electric".split()
NOUN = "kettle lamp chair desk mug backpack clock fan heater mirror stool blender toaster speaker".split()
NOUN_HELD = "teapot lantern bench easel".split()
WORDS = ("apple river stone cloud garden window silver morning forest candle harbor meadow thunder pepper "
         "violet marble lemon anchor canyon falcon").split()
DOMAINS = "example.com mail.org work.net acme.io".split()
SUBJECTS = ["meeting on Monday", "project update", "lunch plans", "the quarterly report", "invoice 4471",
            "travel dates", "weekly summary", "new office hours", "budget review", "team dinner",
            "welcome aboard", "server maintenance", "design feedback", "holiday schedule"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowing", "foggy", "clear", "partly cloudy"]
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = "January February March April May June July August September October November December".split()

# unit symbol -> (dimension, factor to the base unit, names a user may write)
UNITS = {
    "km": ("length", 1000.0, ["km", "kilometers", "kilometres"]),
    "mi": ("length", 1609.344, ["miles", "mi"]),
    "m": ("length", 1.0, ["meters", "metres", "m"]),
    "ft": ("length", 0.3048, ["feet", "ft"]),
    "cm": ("length", 0.01, ["centimeters", "cm"]),
    "in": ("length", 0.0254, ["inches", "in"]),
    "kg": ("mass", 1.0, ["kg", "kilograms"]),
    "lb": ("mass", 0.45359237, ["pounds", "lb", "lbs"]),
    "g": ("mass", 0.001, ["grams", "g"]),
    "oz": ("mass", 0.028349523125, ["ounces", "oz"]),
    "l": ("volume", 1.0, ["liters", "litres", "l"]),
    "gal": ("volume", 3.785411784, ["gallons", "gal"]),
    "ml": ("volume", 0.001, ["milliliters", "ml"]),
    "C": ("temperature", None, ["degrees Celsius", "Celsius", "C"]),
    "F": ("temperature", None, ["degrees Fahrenheit", "Fahrenheit", "F"]),
    "K": ("temperature", None, ["kelvin", "K"]),
}
SINGULAR = {"kilometers": "kilometer", "kilometres": "kilometre", "miles": "mile", "meters": "meter",
            "metres": "metre", "feet": "foot", "centimeters": "centimeter", "inches": "inch",
            "kilograms": "kilogram", "pounds": "pound", "grams": "gram", "ounces": "ounce", "liters": "liter",
            "litres": "litre", "gallons": "gallon", "milliliters": "milliliter"}

# ---------------------------------------------------------------------------------------------
# tool declarations (OpenAI format); two wordings of each description

DESCRIPTIONS = {
    "calculator": ["Evaluate an arithmetic expression and return the result.",
                   "A calculator for arithmetic with + - * / and parentheses."],
    "convert_units": ["Convert a value from one unit to another.",
                      "Unit conversion for length, mass, volume and temperature."],
    "lookup": ["Look up a row of the table described in the system prompt by its key.",
               "Find the entry with the given key in the reference table."],
    "get_weather": ["Get the current weather for a city.", "Current weather conditions in a city."],
    "send_email": ["Send an email.", "Send a short email to an address."],
    "set_timer": ["Start a countdown timer.", "Set a timer for a number of minutes."],
}
UNIT_HELP = "Unit symbol: km, mi, m, ft, cm, in, kg, lb, g, oz, l, gal, ml, C, F or K."
PARAMS = {
    "calculator": {"expression": ("string", "The expression, for example 12 * (3 + 4).")},
    "convert_units": {"value": ("number", "The amount to convert."), "from": ("string", UNIT_HELP),
                      "to": ("string", UNIT_HELP)},
    "lookup": {"key": ("string", "The key of the row, as written in the table.")},
    "get_weather": {"city": ("string", "The city name.")},
    "send_email": {"to": ("string", "The recipient's email address."), "subject": ("string", "The subject line.")},
    "set_timer": {"minutes": ("number", "Length of the timer in minutes.")},
}
TOOL_NAMES = list(PARAMS)


def declaration(name, variant=0):
    props = {k: {"type": t, "description": d} for k, (t, d) in PARAMS[name].items()}
    return {"type": "function", "function": {
        "name": name, "description": DESCRIPTIONS[name][variant],
        "parameters": {"type": "object", "properties": props, "required": list(PARAMS[name])}}}


# capability phrases, for refusals and "what can you do"
ABOUT = {
    "calculator": "do arithmetic with the calculator",
    "convert_units": "convert units",
    "lookup": "look things up in the table",
    "get_weather": "check the weather",
    "send_email": "send emails",
    "set_timer": "set timers",
}
# what a request needs, when no declared tool offers it: (subject of the refusal, tool it needs)
IMPOSSIBLE = [
    ("Book a flight to {city} for next Friday.", "book flights"),
    ("Order a pizza to my office, please.", "order food"),
    ("Play some jazz music.", "play music"),
    ("Search the web for the latest news about {city}.", "search the web"),
    ("Turn off the lights in the living room.", "control smart home devices"),
    ("Call {name} on the phone for me.", "make phone calls"),
    ("What time is it in {city} right now?", "check the current time"),
    ("Remind me tomorrow at 9 to call {name}.", "set reminders"),
    ("Take a screenshot of my screen.", "take screenshots"),
    ("Translate this into French: {words}.", "translate text"),
]


# ---------------------------------------------------------------------------------------------
# the tools' implementations (the eval harness runs the model's own arguments through these)

def fmt_num(x):
    """Numbers as the tools print them: integers without a point, others to at most 6 decimals."""
    if isinstance(x, bool):
        raise TypeError
    x = round(float(x), 6)
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return repr(x)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calc(expr):
    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            return -ev(n.operand) if isinstance(n.op, ast.USub) else ev(n.operand)
        raise ValueError("unsupported expression")
    try:
        return fmt_num(ev(ast.parse(str(expr).replace("x", "*"), mode="eval")))
    except ZeroDivisionError:
        return "error: division by zero"
    except Exception:
        return "error: invalid expression"


def convert(value, frm, to):
    if frm not in UNITS or to not in UNITS:
        return {"error": f"unknown unit {frm if frm not in UNITS else to}"}
    (d1, f1, _), (d2, f2, _) = UNITS[frm], UNITS[to]
    if d1 != d2:
        return {"error": f"cannot convert {frm} to {to}"}
    try:
        v = float(value)
    except (TypeError, ValueError):
        return {"error": "value must be a number"}
    if d1 == "temperature":
        c = {"C": v, "F": (v - 32) * 5 / 9, "K": v - 273.15}[frm]
        out = {"C": c, "F": c * 9 / 5 + 32, "K": c + 273.15}[to]
    else:
        out = v * f1 / f2
    r = round(out, 2)
    return {"value": int(r) if r == int(r) else r, "unit": to}


def weather(city):
    h = zlib.crc32(str(city).strip().lower().encode())
    return {"city": str(city), "temperature_c": h % 35 - 5, "condition": CONDITIONS[(h >> 8) % len(CONDITIONS)]}


def run_tool(name, args, ctx):
    """The tool result (the `content` of the tool message) for a call; `ctx` holds the table."""
    if not isinstance(args, dict):
        return json.dumps({"error": "arguments must be an object"})
    try:
        if name == "calculator":
            return calc(args["expression"])
        if name == "convert_units":
            return json.dumps(convert(args["value"], args["from"], args["to"]))
        if name == "lookup":
            key = str(args["key"]).strip().lower()
            for row in (ctx.get("table") or {}).get("rows", []):
                if row[0].lower() == key:
                    return json.dumps(dict(zip(ctx["table"]["columns"], row)))
            return json.dumps({"error": f"no row with key {args['key']}"})
        if name == "get_weather":
            return json.dumps(weather(args["city"]))
        if name == "send_email":
            return json.dumps({"status": "sent", "to": str(args["to"])})
        if name == "set_timer":
            return json.dumps({"status": "started", "minutes": args["minutes"]})
    except KeyError as e:
        return json.dumps({"error": f"missing argument {e.args[0]}"})
    return json.dumps({"error": f"unknown tool {name}"})


# ---------------------------------------------------------------------------------------------
# tables

TABLES = {
    "staff": {"columns": ["name", "phone", "office"],
              "asks": {"phone": ["What is {k}'s phone number?", "Give me the phone number of {k}.",
                                 "How can I call {k}? I need the number.", "What's the phone number for {k}?"],
                       "office": ["Which office is {k} in?", "Where does {k} sit?", "What is {k}'s office?",
                                  "In which office can I find {k}?"]},
              "says": {"phone": "{k}'s phone number is {v}.", "office": "{k} is in office {v}."}},
    "products": {"columns": ["product", "price", "stock"],
                 "asks": {"price": ["How much does the {k} cost?", "What's the price of the {k}?",
                                    "What does the {k} cost?"],
                          "stock": ["How many {k} units are in stock?", "What is the stock of the {k}?",
                                    "How many of the {k} do we have?"]},
                 "says": {"price": "The {k} costs {v}.", "stock": "There are {v} units of the {k} in stock."}},
    "flights": {"columns": ["flight", "gate", "departs"],
                "asks": {"gate": ["Which gate does flight {k} leave from?", "What gate is {k} at?",
                                  "Gate for flight {k}?"],
                         "departs": ["When does flight {k} depart?", "What time does {k} leave?",
                                     "Departure time of flight {k}?"]},
                "says": {"gate": "Flight {k} leaves from gate {v}.", "departs": "Flight {k} departs at {v}."}},
}

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are Kimi, a helpful assistant.",
                  "You are a concise assistant. Use the tools when they help.", "Answer briefly and politely.",
                  "You are a friendly assistant for a small office.", "Be helpful and accurate.",
                  "You are an assistant that can call tools."]


class Gen:
    """Conversations for one split; `heldout=True` mixes in the held-out name pools."""

    def __init__(self, seed, heldout=False):
        self.r = random.Random(seed)
        self.heldout = heldout

    # -- pools
    def pool(self, base, held):
        r = self.r
        if self.heldout:
            return r.choice(held) if r.random() < 0.5 else r.choice(base)
        return self.made_up() if r.random() < 0.5 else r.choice(base)

    def made_up(self):
        r = self.r
        return "".join(r.choice(SYLLABLES) for _ in range(r.randint(2, 3))).capitalize()

    def person(self):
        return f"{self.pool(FIRST, FIRST_HELD)} {self.pool(LAST, LAST_HELD)}"

    def city(self):
        return self.pool(CITIES, CITIES_HELD)

    def product(self):
        return f"{self.r.choice(ADJ)} {self.pool(NOUN, NOUN_HELD)}"

    def number(self, small=False):
        r = self.r
        u = r.random()
        if small or u < 0.45:
            return str(r.randint(1, 99))
        if u < 0.8:
            return str(r.randint(100, 9999))
        if u < 0.93:
            return f"{r.randint(0, 999)}.{r.randint(1, 99)}"
        return str(r.randint(10000, 999999))

    def make_table(self, kind):
        r = self.r
        rows, seen = [], set()
        for _ in range(r.randint(3, 5)):
            if kind == "staff":
                k = self.person()
                row = [k, f"555-{r.randint(0, 9999):04d}", f"{r.choice('ABCDEFG')}{r.randint(1, 40)}"]
            elif kind == "products":
                k = self.product()
                row = [k, f"${r.randint(3, 400)}.{r.choice(['00', '50', '99', '25', '75'])}", str(r.randint(0, 300))]
            else:
                k = f"{r.choice(['KX', 'LH', 'BA', 'AF', 'TP', 'QR', 'NZ'])}{r.randint(10, 999)}"
                row = [k, f"{r.choice('ABCDE')}{r.randint(1, 30)}", f"{r.randint(5, 23):02d}:{r.choice(['05', '15', '30', '45', '50'])}"]
            if k.lower() not in seen:
                seen.add(k.lower())
                rows.append(row)
        return {"kind": kind, "columns": TABLES[kind]["columns"], "rows": rows}

    # -- a whole conversation context
    def context(self, force_tools=None):
        """Declared tools, system prompt and table for a conversation."""
        r = self.r
        if force_tools is not None:
            names = list(force_tools)
        elif r.random() < 0.12:
            names = []
        else:
            k = r.choice([1, 1, 2, 2, 3, 3, 4, 5, 6])
            names = r.sample(TOOL_NAMES, k)
        r.shuffle(names)
        ctx = {"tools": names, "variants": {n: r.randrange(2) for n in names}, "table": None, "table_in_prompt": False}
        parts = []
        if r.random() < 0.7 or "lookup" in names:
            parts.append(r.choice(SYSTEM_PROMPTS))
        if "lookup" in names:
            t = self.make_table(r.choice(list(TABLES)))
            ctx["table"] = t
            parts.append(f"The lookup tool searches the {t['kind']} table (columns: {', '.join(t['columns'])}).")
        elif r.random() < 0.35:
            t = self.make_table(r.choice(list(TABLES)))
            ctx["table"], ctx["table_in_prompt"] = t, True
            lines = [f"{t['kind'].capitalize()} table ({', '.join(t['columns'])}):"]
            lines += [f"- {row[0]}: {t['columns'][1]} {row[1]}, {t['columns'][2]} {row[2]}" for row in t["rows"]]
            parts.append("\n".join(lines))
        ctx["system"] = "\n\n".join(parts) if parts else None
        return ctx

    def tools_json(self, ctx):
        return [declaration(n, ctx["variants"][n]) for n in ctx["tools"]]

    # -- single pieces of an exchange
    def polite(self, q):
        r = self.r
        u = r.random()
        if u < 0.12:
            q = "Please, " + q[0].lower() + q[1:]
        elif u < 0.22:
            q = r.choice(["Hi! ", "Hey, ", "Quick question: ", "Hello. "]) + q
        if r.random() < 0.08:
            q += r.choice([" Thanks!", " Thank you.", " Thanks in advance."])
        return q

    def arithmetic(self):
        """(question, expression, short description)."""
        r = self.r
        a, b = self.number(), self.number()
        if r.random() < 0.55:
            ops = r.choice(["+", "-", "*", "/"])
            if r.random() < 0.3:
                c = self.number(small=True)
                op2 = r.choice(["+", "-", "*"])
                e = f"({a} {ops} {b}) {op2} {c}" if r.random() < 0.5 else f"{a} {ops} {b} {op2} {c}"
            else:
                e = f"{a} {ops} {b}"
            shown = e.replace(" ", "") if r.random() < 0.2 else e
            q = r.choice(["What is {e}?", "Compute {e}.", "Calculate {e}, please.", "{e} = ?", "How much is {e}?",
                          "Can you work out {e}?", "What's {e}?", "Evaluate {e}."]).format(e=shown)
            return q, shown, shown
        kind = r.choice(["times", "plus", "minus", "div", "mul", "add", "sub", "pct"])
        if kind == "pct":
            p = str(r.randint(1, 99))
            return r.choice([f"What is {p}% of {a}?", f"How much is {p} percent of {a}?"]), f"{a} * {p} / 100", f"{p}% of {a}"
        q, e = {
            "times": (f"What is {a} times {b}?", f"{a} * {b}"),
            "plus": (f"What is {a} plus {b}?", f"{a} + {b}"),
            "minus": (f"What is {a} minus {b}?", f"{a} - {b}"),
            "div": (f"What is {a} divided by {b}?", f"{a} / {b}"),
            "mul": (f"Multiply {a} by {b}.", f"{a} * {b}"),
            "add": (f"Add {a} and {b}.", f"{a} + {b}"),
            "sub": (f"Subtract {b} from {a}.", f"{a} - {b}"),
        }[kind]
        return q, e, e

    def unit_name(self, sym, value):
        n = self.r.choice(UNITS[sym][2])
        return SINGULAR.get(n, n) if value in ("1", "1.0") else n

    def conversion(self):
        r = self.r
        dim = r.choice(["length", "length", "mass", "volume", "temperature"])
        syms = [s for s, u in UNITS.items() if u[0] == dim]
        frm, to = r.sample(syms, 2)
        v = self.number(small=r.random() < 0.6)
        if dim == "temperature" and r.random() < 0.2:
            v = "-" + v
        fn, tn = self.unit_name(frm, v), self.unit_name(to, "2")
        q = r.choice(["How many {t} is {v} {f}?", "Convert {v} {f} to {t}.", "What is {v} {f} in {t}?",
                      "{v} {f} in {t}?", "Can you convert {v} {f} into {t}?", "How much is {v} {f} in {t}?"])
        return q.format(v=v, f=fn, t=tn), {"value": json.loads(v), "from": frm, "to": to}, (v, fn, tn)

    # -- exchanges: each returns a dict with the user text, the assistant steps and what is expected
    def ex_call(self, ctx, tool, calls=None):
        """A request for `tool`; returns the exchange (with tool results executed)."""
        r = self.r
        q, args, think, answer = self.call_parts(ctx, tool)
        return self.tool_exchange(ctx, self.polite(q), [(tool, args, think, answer)])

    def call_parts(self, ctx, tool):
        r = self.r
        if tool == "calculator":
            q, e, shown = self.arithmetic()
            think = r.choice(["The user wants {s}. I will use the calculator.", "I need to compute {s}, so I'll call the calculator.",
                              "This is arithmetic: {s}. Calling the calculator."]).format(s=shown)
            def answer(res):
                if res.startswith("error"):
                    return f"The calculator could not evaluate that ({res})."
                return r.choice(["{s} = {v}.", "The result is {v}.", "{s} is {v}.", "It comes to {v}."]).format(s=shown, v=res)
            return q, {"expression": e}, think, answer
        if tool == "convert_units":
            q, args, (v, fn, tn) = self.conversion()
            think = r.choice(["The user wants {v} {f} in {t}. I'll use convert_units.",
                              "Converting {v} {f} to {t}: I will call convert_units."]).format(v=v, f=fn, t=tn)
            def answer(res):
                d = json.loads(res)
                if "error" in d:
                    return f"I could not convert that: {d['error']}."
                return r.choice(["{v} {f} is {o} {t}.", "That is {o} {t}.", "{v} {f} equals {o} {t}."]).format(
                    v=v, f=fn, o=fmt_num(d["value"]), t=tn)
            return q, args, think, answer
        if tool == "lookup":
            t = ctx["table"]
            spec = TABLES[t["kind"]]
            col = r.choice(t["columns"][1:])
            if r.random() < 0.85:
                key = r.choice(t["rows"])[0]
            else:
                key = {"staff": self.person, "products": self.product,
                       "flights": lambda: f"ZZ{r.randint(10, 999)}"}[t["kind"]]()
            q = r.choice(spec["asks"][col]).format(k=key)
            self.asked_col = col
            think = r.choice(["I need the {c} of {k} from the {t} table. I'll use lookup.",
                              "The {t} table has this. Looking up {k}."]).format(c=col, k=key, t=t["kind"])
            def answer(res):
                d = json.loads(res)
                if "error" in d:
                    return f"I couldn't find {key} in the {t['kind']} table."
                return spec["says"][col].format(k=d[t["columns"][0]], v=d[col])
            return q, {"key": key}, think, answer
        if tool == "get_weather":
            c = self.city()
            q = r.choice(["What's the weather in {c}?", "How is the weather in {c} today?", "Is it raining in {c}?",
                          "What is the temperature in {c}?", "Weather in {c}?"]).format(c=c)
            think = r.choice(["The user asks about the weather in {c}. I'll call get_weather.",
                              "I need the current weather for {c}."]).format(c=c)
            def answer(res):
                d = json.loads(res)
                return r.choice(["In {c} it is {t} degrees C and {w}.", "It is {w} in {c}, {t} degrees C."]).format(
                    c=d["city"], t=d["temperature_c"], w=d["condition"])
            return q, {"city": c}, think, answer
        if tool == "send_email":
            who = self.person().split()
            addr = f"{who[0].lower()}.{who[1].lower()}@{r.choice(DOMAINS)}"
            subj = r.choice(SUBJECTS)
            q = r.choice(["Send an email to {a} with the subject \"{s}\".", "Email {a} about {s}.",
                          "Please send {a} an email, subject: {s}."]).format(a=addr, s=subj)
            think = f"I'll send the email to {addr} with send_email."
            return q, {"to": addr, "subject": subj}, think, (lambda res: r.choice(
                ["Done: the email to {a} has been sent.", "I sent the email about {s} to {a}."]).format(a=addr, s=subj))
        if tool == "set_timer":
            m = str(r.choice([1, 2, 3, 5, 10, 15, 20, 25, 30, 45, 60, 90, r.randint(1, 120)]))
            q = r.choice(["Set a timer for {m} minutes.", "Start a {m} minute timer.", "Timer for {m} minutes, please.",
                          "Can you set a {m}-minute timer?"]).format(m=m)
            think = f"A timer for {m} minutes: I'll call set_timer."
            return q, {"minutes": int(m)}, think, (lambda res: r.choice(
                ["Your {m} minute timer has started.", "Timer set for {m} minutes."]).format(m=m))
        raise ValueError(tool)

    def tool_exchange(self, ctx, q, parts, required=False):
        """call(s), results, final answer."""
        r = self.r
        calls = [(tool, args) for tool, args, _, _ in parts]
        cols = [getattr(self, "asked_col", None) if tool == "lookup" else None for tool, _ in calls]
        think1 = " ".join(p[2] for p in parts)
        results = [run_tool(t, a, ctx) for t, a in calls]
        think2 = " ".join(r.choice(["The {t} tool returned {s}.", "{t} gave {s}."]).format(t=t, s=self.summarise(res))
                          for (t, _), res in zip(calls, results))
        final = " ".join(p[3](res) for p, res in zip(parts, results))
        return {"kind": "call", "user": q, "calls": calls, "results": results, "think1": think1,
                "content1": "", "think2": think2, "final": final, "required": required, "cols": cols}

    @staticmethod
    def summarise(res):
        return res if len(res) <= 80 else res[:77] + "..."

    def ex_refuse(self, ctx):
        r = self.r
        missing = [t for t in TOOL_NAMES if t not in ctx["tools"] and t != "lookup"]
        if missing and r.random() < 0.6:
            tool = r.choice(missing)
            q, _, _, _ = self.call_parts(ctx, tool)
            need = ABOUT[tool]
            think = f"This needs a tool to {need}, but no such tool is declared."
        else:
            tmpl, need = r.choice(IMPOSSIBLE)
            q = tmpl.format(city=self.city(), name=self.person(), words=" ".join(r.sample(WORDS, 3)))
            think = f"This needs a tool to {need}, and I have none for that."
        can = self.capabilities(ctx)
        final = r.choice(["Sorry, I can't {n} here: I don't have a tool for that.",
                          "I'm sorry, but I can't {n} because no tool for it is available.",
                          "Unfortunately I am not able to {n}; that tool is not available to me."]).format(n=need)
        final += " " + can
        return {"kind": "refuse", "user": self.polite(q), "think2": think, "final": final, "need": need}

    def capabilities(self, ctx):
        t = ctx["tools"]
        if not t:
            return "I can chat and answer simple questions."
        return "I can " + join_and([ABOUT[n] for n in t]) + "."

    def ex_direct(self, ctx):
        r = self.r
        u = r.random()
        if ctx["table_in_prompt"] and u < 0.6:
            t = ctx["table"]
            spec = TABLES[t["kind"]]
            row = r.choice(t["rows"])
            ci = r.randrange(1, 3)
            col = t["columns"][ci]
            q = r.choice(spec["asks"][col]).format(k=row[0])
            think = f"The {t['kind']} table in the prompt lists {row[0]} with {col} {row[ci]}."
            return {"kind": "direct", "user": self.polite(q), "think2": think,
                    "final": spec["says"][col].format(k=row[0], v=row[ci]), "expect": [row[ci]]}
        if u < 0.75:
            phrase = " ".join(r.sample(WORDS, r.randint(2, 5)))
            q = r.choice(["Repeat after me: {p}", "Say this back to me: {p}", "Please repeat: {p}"]).format(p=phrase)
            return {"kind": "direct", "user": q, "think2": "The user wants the phrase repeated.",
                    "final": phrase, "expect": [phrase]}
        seq, name = (DAYS, "day") if r.random() < 0.5 else (MONTHS, "month")
        i = r.randrange(len(seq))
        after = r.random() < 0.6
        j = (i + 1) % len(seq) if after else (i - 1) % len(seq)
        w = "after" if after else "before"
        q = r.choice([f"What {name} comes {w} {seq[i]}?", f"Which {name} is {w} {seq[i]}?"])
        return {"kind": "direct", "user": q, "think2": f"The {name} {w} {seq[i]} is {seq[j]}.",
                "final": f"The {name} {w} {seq[i]} is {seq[j]}.", "expect": [seq[j]]}

    def ex_chat(self, ctx):
        r = self.r
        can = self.capabilities(ctx)
        k = r.choice(["hi", "hi", "how", "thanks", "who", "what", "what", "bye", "joke"])
        q, think, final = {
            "hi": (r.choice(["Hi!", "Hello", "Hey there", "Good morning!", "Hello, assistant.", "Hi, how's it going?"]),
                   "The user is greeting me.",
                   r.choice(["Hello! How can I help you today?", "Hi! What can I do for you?"])),
            "how": (r.choice(["How are you?", "How are you doing today?", "Are you doing well?"]),
                    "A friendly question about me.", "I'm doing well, thanks for asking! How can I help?"),
            "thanks": (r.choice(["Thanks!", "Thank you very much.", "Great, thanks.", "That's all, thank you."]),
                       "The user is thanking me.", r.choice(["You're welcome!", "Glad I could help."])),
            "who": (r.choice(["Who are you?", "What is your name?", "Are you a person?"]),
                    "The user asks who I am.",
                    "I'm k3-chat, a small assistant model with the Kimi K3 architecture."),
            "what": (r.choice(["What can you do?", "Which tools do you have?", "How can you help me?"]),
                     "The user asks what I can do.", can),
            "bye": (r.choice(["Bye!", "Goodbye.", "See you later."]), "The user is leaving.", "Goodbye! Have a nice day."),
            "joke": ("Tell me a joke.", "A short joke.",
                     r.choice(["Why did the scarecrow win an award? Because he was outstanding in his field.",
                               "I told my computer a joke about UDP. I am not sure it got it."])),
        }[k]
        return {"kind": "chat", "user": q, "think2": think, "final": final, "expect": []}

    def exchange(self, ctx, kind=None):
        r = self.r
        callable_tools = [t for t in ctx["tools"]]
        if kind is None:
            u = r.random()
            if callable_tools and u < 0.55:
                kind = "call"
            elif u < 0.72:
                kind = "refuse"
            elif u < 0.86:
                kind = "direct"
            else:
                kind = "chat"
        if kind == "call":
            if len(callable_tools) >= 2 and r.random() < 0.08:
                picks = r.sample(callable_tools, 2)
                parts = [self.call_parts(ctx, t) for t in picks]
                q = parts[0][0].rstrip(".?") + r.choice([", and ", ". Also, "]) + parts[1][0][0].lower() + parts[1][0][1:]
                if picks[1] in ("lookup",):
                    q = parts[0][0] + " " + parts[1][0]
                return self.tool_exchange(ctx, q, [(t, p[1], p[2], p[3]) for t, p in zip(picks, parts)])
            tool = r.choice(callable_tools)
            ex = self.ex_call(ctx, tool)
            ex["required"] = r.random() < 0.1
            return ex
        return {"refuse": self.ex_refuse, "direct": self.ex_direct, "chat": self.ex_chat}[kind](ctx)

    # -- requests
    def messages_for(self, ctx, exchanges, keep_history_reasoning):
        """OpenAI messages for the exchanges (all complete)."""
        msgs = []
        if ctx["system"]:
            msgs.append({"role": "system", "content": ctx["system"]})
        n = 0
        for xi, ex in enumerate(exchanges):
            last = xi == len(exchanges) - 1
            keep = last or keep_history_reasoning
            msgs.append({"role": "user", "content": ex["user"]})
            if ex["kind"] == "call":
                tcs = []
                for tool, args in ex["calls"]:
                    n += 1
                    tcs.append({"id": f"call_{n}", "type": "function",
                                "function": {"name": tool, "arguments": json.dumps(args)}})
                m = {"role": "assistant", "content": ex["content1"], "tool_calls": tcs}
                if keep:
                    m["reasoning_content"] = ex["think1"]
                msgs.append(m)
                for tc, res in zip(tcs, ex["results"]):
                    msgs.append({"role": "tool", "tool_call_id": tc["id"], "content": res})
            m = {"role": "assistant", "content": ex["final"]}
            if keep:
                m["reasoning_content"] = ex["think2"]
            msgs.append(m)
        return msgs

    def conversation(self):
        """A training conversation: a request dict (OpenAI shape, all messages complete)."""
        r = self.r
        ctx = self.context()
        n = r.choice([1, 1, 1, 2, 2, 3])
        exchanges = [self.exchange(ctx) for _ in range(n)]
        req = {"messages": self.messages_for(ctx, exchanges, r.random() < 0.5)}
        if ctx["tools"]:
            req["tools"] = self.tools_json(ctx)
        u = r.random()
        if u < 0.05:
            req["reasoning_effort"] = "none"
        elif u < 0.1:
            req["reasoning_effort"] = r.choice(["low", "high"])
        if exchanges[-1].get("required"):
            # tool_choice=required renders a note after the messages: only meaningful for a prompt
            # that ends before the call, so keep only what precedes the calling assistant turn + it
            req["tool_choice"] = "required"
        return req, ctx, exchanges

    def episode(self, kind, tool=None):
        """A held-out evaluation episode: context + one exchange of the given kind."""
        if kind == "call":
            ctx = self.context()
            while tool not in ctx["tools"]:
                ctx = self.context()
            ex = self.ex_call(ctx, tool)
        elif kind == "refuse":
            ctx = self.context()
            ex = self.ex_refuse(ctx)
        elif kind == "direct":
            ctx = self.context()
            ex = self.ex_direct(ctx)
        else:
            ctx = self.context()
            ex = self.ex_chat(ctx)
        return ctx, ex


def join_and(xs):
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " and " + xs[-1]
