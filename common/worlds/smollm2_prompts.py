"""Prompts of the real small world: coding-heavy chat requests, as in the v4 mix, made deterministically.

Training families (the draft learns the target's answers to these):
  write_function  a signature and what it must do -> the function
  explain_code    a small function's source -> what it does
  add_docstring   a function without its docstring -> a docstring
  usage_example   a standard-library function's name -> a short usage example
  fix_bug         a function with one planted bug -> the fix
  small_program   a small program to write (task list below)
  concept         a Python concept to explain
  tool_request    a tool-call style request: two tool schemas in the prompt, answer with a JSON call
Held-out families (never trained; 05 measures tau on them, so tau measures generalisation):
  to_javascript   a function -> the same in JavaScript
  write_tests     a function -> pytest tests
  code_review     a function -> one improvement
  sql_query       a task -> an SQL query
Functions come from the Python standard library (common/worlds/tiny_tasks.py collects them); held-out
families use only functions of the held-out hash split, so neither the family nor the function of a
held-out prompt was seen in training. The prompt set is built once and shipped in
assets/smollm2/prompts.jsonl.gz (the stdlib differs between Python versions); tests check that this
module still makes exactly that file on the Python version recorded in it.
"""
from __future__ import annotations

import json
import random
import re

from common.worlds.tiny_tasks import collect_functions, is_held_out, stable_hash, stdlib_files

TRAIN_FAMILIES = {"write_function": 220, "explain_code": 220, "add_docstring": 190, "usage_example": 190,
                  "fix_bug": 190, "small_program": 160, "concept": 150, "tool_request": 280}
FUNCTION_FAMILIES = ("write_function", "explain_code", "add_docstring", "usage_example", "fix_bug")
HELD_OUT_FAMILIES = {"to_javascript": 30, "write_tests": 30, "code_review": 30, "sql_query": 30}
HELD_OUT_SHARE = 0.2

PROGRAM_TASKS = [
    "reads a text file and prints how many words it contains",
    "prints the first {n} prime numbers",
    "prints the Fibonacci numbers below {m}",
    "asks the user for a number and prints its factorial",
    "reads a CSV file and prints the average of the second column",
    "counts how often each letter appears in a string",
    "checks whether a string is a palindrome",
    "converts a temperature from Celsius to Fahrenheit",
    "finds the largest number in a list without using max()",
    "removes duplicates from a list while keeping the order",
    "merges two sorted lists into one sorted list",
    "prints a multiplication table up to {n}",
    "reverses the words in a sentence",
    "counts the lines in every .py file of a directory",
    "renames every .txt file in a folder to lower case",
    "generates a random password of {n} characters",
    "sorts a list of dictionaries by the value of the key 'age'",
    "prints the current date and time in ISO format",
    "downloads nothing but parses a URL and prints its host and path",
    "reads JSON from a file and prints its top-level keys",
    "computes the greatest common divisor of two numbers",
    "prints all files larger than {m} bytes in a directory tree",
    "implements binary search on a sorted list",
    "implements bubble sort and sorts {n} random numbers",
    "counts the vowels in a sentence",
    "flattens a nested list of lists",
    "prints the n-th triangular number for n = 1 to {n}",
    "simulates rolling two dice {m} times and prints the frequencies",
    "checks whether a year is a leap year",
    "converts a decimal number to binary without using bin()",
    "finds all anagrams of a word in a list of words",
    "implements a stack class with push, pop and peek",
    "implements a queue with two stacks",
    "computes the mean, median and mode of a list",
    "writes a list of names to a file, one per line",
    "parses command-line arguments with argparse and prints them",
    "validates an email address with a regular expression",
    "prints a histogram of word lengths in a text",
    "transposes a matrix given as a list of lists",
    "checks whether two strings are anagrams",
    "computes compound interest for {n} years",
    "finds the second largest number in a list",
    "capitalizes the first letter of every word in a sentence",
    "counts the frequency of words in a file and prints the {n} most common",
    "implements a simple to-do list in the terminal",
    "converts a Roman numeral to an integer",
    "computes the sum of the digits of a number",
    "times how long a function takes to run",
    "reads a file line by line and prints the longest line",
    "implements a linked list with append and print methods",
]
CONCEPTS = [
    "list comprehensions", "generators", "decorators", "context managers", "the with statement",
    "lambda functions", "*args and **kwargs", "dictionary comprehensions", "the GIL", "virtual environments",
    "exceptions and try/except", "classes and objects", "inheritance", "dataclasses", "type hints",
    "f-strings", "slicing", "iterators", "the yield keyword", "mutable default arguments",
    "shallow and deep copies", "the __init__ method", "modules and packages", "the if __name__ == "
    "'__main__' idiom", "sets", "tuples versus lists", "async and await", "closures", "recursion",
    "the map and filter functions", "enumerate", "zip", "string formatting", "file handling",
    "the pathlib module", "unit testing with unittest", "pip and requirements files", "properties",
    "static methods and class methods", "duck typing", "the collections module", "regular expressions",
    "JSON serialization", "the logging module", "multiprocessing", "threads", "global and nonlocal",
]
CONCEPT_ASKS = ("Explain {c} in Python with a short example.", "What are {c} in Python? Keep it brief.",
                "How do {c} work in Python?", "When should I use {c} in Python?")
TOOLS = [
    ("get_weather", "Get the current weather for a city.", {"city": "string", "unit": "string"}),
    ("search_files", "Search files in a repository for a text pattern.", {"pattern": "string", "path": "string"}),
    ("run_tests", "Run the test suite of a project.", {"path": "string", "verbose": "boolean"}),
    ("read_file", "Read a file and return its contents.", {"path": "string"}),
    ("write_file", "Write text to a file.", {"path": "string", "content": "string"}),
    ("send_email", "Send an email.", {"to": "string", "subject": "string", "body": "string"}),
    ("create_issue", "Open an issue in the tracker.", {"title": "string", "labels": "array"}),
    ("convert_currency", "Convert an amount between currencies.",
     {"amount": "number", "from_currency": "string", "to_currency": "string"}),
    ("get_stock_price", "Get the latest price of a stock.", {"symbol": "string"}),
    ("translate_text", "Translate text into another language.", {"text": "string", "target_language": "string"}),
    ("list_directory", "List the files in a directory.", {"path": "string"}),
    ("run_shell", "Run a shell command and return its output.", {"command": "string"}),
    ("git_commit", "Commit staged changes with a message.", {"message": "string"}),
    ("book_meeting", "Book a meeting room.", {"room": "string", "start": "string", "minutes": "integer"}),
    ("calculate", "Evaluate an arithmetic expression.", {"expression": "string"}),
    ("http_get", "Fetch a URL with an HTTP GET request.", {"url": "string"}),
]
TOOL_REQUESTS = {
    "get_weather": ["What's the weather in {city} right now?", "Is it cold in {city} today, in Celsius?"],
    "search_files": ["Find where `{ident}` is used under src/.", "Search the repo for TODO comments in {path}."],
    "run_tests": ["Run the tests in {path} with verbose output.", "Please run the test suite of {path}."],
    "read_file": ["Show me the contents of {path}.", "Open {path} for me."],
    "write_file": ["Save the text 'hello {city}' into {path}.", "Create {path} containing a single newline."],
    "send_email": ["Email alice@example.com that the build in {path} passed.",
                   "Send bob@example.com a note titled 'meeting' about {city}."],
    "create_issue": ["Open an issue titled '{ident} crashes on empty input' with the label bug.",
                     "File a feature request to support {city} time zones."],
    "convert_currency": ["How much is {n} US dollars in euros?", "Convert {n} GBP to JPY."],
    "get_stock_price": ["What is the price of {sym} right now?", "Look up the stock price of {sym}."],
    "translate_text": ["Translate 'good morning, {city}' into French.", "How do you say 'thank you' in {lang}?"],
    "list_directory": ["What files are in {path}?", "List everything under {path}."],
    "run_shell": ["Count the lines of {path} with wc.", "Show the disk usage of {path}."],
    "git_commit": ["Commit my changes with the message 'fix {ident}'.", "Make a commit saying 'update {path}'."],
    "book_meeting": ["Book room {room} at 10:00 for {n} minutes.", "Reserve {room} tomorrow at 14:30 for an hour."],
    "calculate": ["What is {n} times 37 plus 12?", "Compute ({n} - 4) / 3."],
    "http_get": ["Fetch https://example.com/{ident} for me.", "Get the page at https://{city}.example.org."],
}
CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Austin", "Seoul", "Cairo", "Berlin", "Toronto"]
LANGS = ["German", "Spanish", "Italian", "Japanese", "Korean"]
SYMBOLS = ["AAPL", "MSFT", "NVDA", "TSLA", "AMZN"]
ROOMS = ["A1", "B2", "Orion", "Lyra"]
SQL_TASKS = [
    "lists all customers from Germany", "counts the orders placed in 2023",
    "finds the five most expensive products", "shows each department with its average salary",
    "finds employees who earn more than their manager", "lists customers who never placed an order",
    "returns the total sales per month", "finds duplicate email addresses in a users table",
    "deletes sessions older than 30 days", "shows the top three customers by total spending",
    "lists products that are out of stock", "counts users per country, largest first",
    "finds the second highest salary", "joins orders with customers and shows the customer name",
    "updates the price of all books by 10 percent", "lists the names of students enrolled in two courses",
    "shows the number of posts per author", "finds the earliest and latest order date",
    "lists all tables' row counts for a given schema", "returns orders with more than three items",
    "finds cities with more than 100 customers", "computes a running total of daily sales",
    "lists employees hired in the last 90 days", "shows the average rating of each movie",
    "finds products never ordered", "ranks salespeople by revenue within each region",
    "returns the percentage of orders that were refunded", "lists customers whose name starts with A",
    "groups invoices by status and counts them", "finds the busiest hour of the day for orders",
]
BUGS = [(r" \+ ", " - "), (r" < ", " <= "), (r" > ", " >= "), (r" == ", " != "), (r"\bTrue\b", "False"),
        (r"\band\b", "or"), (r"\bnot ", ""), (r" - 1\b", " + 1"), (r"\[0\]", "[1]"), (r"\bNone\b", "0")]


def _source(fn: dict) -> str:
    return f"{fn['signature']}\n{fn['body']}"


def _plant_bug(fn: dict, rng: random.Random) -> str | None:
    for pattern, repl in rng.sample(BUGS, len(BUGS)):
        if re.search(pattern, fn["body"]):
            return fn["signature"] + "\n" + re.sub(pattern, repl, fn["body"], count=1)
    return None


def _tool_schema(name: str, description: str, params: dict) -> dict:
    props = {k: ({"type": t, "items": {"type": "string"}} if t == "array" else {"type": t})
             for k, t in params.items()}
    return {"name": name, "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(params)[:1]}}


def _tool_prompt(rng: random.Random) -> str:
    first, second = rng.sample(TOOLS, 2)
    asked = first
    request = rng.choice(TOOL_REQUESTS[asked[0]]).format(
        city=rng.choice(CITIES), path=rng.choice(["src/app.py", "tests/", "README.md", "data/log.txt",
                                                  "notes/todo.md", "lib/utils.py"]),
        ident=rng.choice(["parse_args", "load_config", "UserModel", "retry", "cache_key"]),
        n=rng.randint(2, 500), sym=rng.choice(SYMBOLS), lang=rng.choice(LANGS), room=rng.choice(ROOMS))
    tools = [_tool_schema(*t) for t in rng.sample([first, second], 2)]
    return ("You can call these functions:\n" + json.dumps(tools) +
            "\n\nTo call one, reply with a JSON object {\"name\": ..., \"arguments\": {...}} and nothing "
            f"else.\n\nRequest: {request}")


def _function_prompt(family: str, fn: dict, rng: random.Random) -> str | None:
    src = f"```python\n{_source(fn)}\n```"
    if family == "write_function":
        return f"Write a Python function `{fn['name']}({fn['args']})`. {fn['summary']}"
    if family == "explain_code":
        return rng.choice(("Explain what this Python function does.", "What does this code do?",
                           "Walk me through this function briefly.")) + f"\n\n{src}"
    if family == "add_docstring":
        return f"Add a docstring to this Python function.\n\n{src}"
    if family == "usage_example":
        return f"Show a short example of using `{fn['module']}.{fn['local']}` from the Python standard library."
    if family == "fix_bug":
        buggy = _plant_bug(fn, rng)
        return None if buggy is None else f"This function has a bug. Find it and fix it.\n\n```python\n{buggy}\n```"
    if family == "to_javascript":
        return f"Rewrite this Python function in JavaScript.\n\n{src}"
    if family == "write_tests":
        return f"Write pytest tests for this function.\n\n{src}"
    if family == "code_review":
        return f"Review this code and suggest one improvement.\n\n{src}"
    raise ValueError(family)


def _family_prompts(family: str, count: int, functions: list[dict], seed: int) -> list[dict]:
    """`count` distinct prompts of `family`, each {"id", "family", "messages"}; ids are unique and stable.
    Candidate i depends on (seed, family, i) only, and a candidate whose text an earlier one already has
    is skipped, so the set grows by appending: the kept prompts never change."""
    rows, seen = [], set()
    if family in ("small_program", "concept", "tool_request", "sql_query"):
        for i in range(100 * count):
            if len(rows) == count:
                break
            rng = random.Random(stable_hash(f"{seed}:{family}:{i}"))
            if family == "small_program":
                task = PROGRAM_TASKS[i % len(PROGRAM_TASKS)].format(n=rng.randint(5, 20), m=rng.choice([100, 1000, 5000]))
                text = f"Write a Python program that {task}."
            elif family == "concept":
                text = CONCEPT_ASKS[(i // len(CONCEPTS)) % len(CONCEPT_ASKS)].format(c=CONCEPTS[i % len(CONCEPTS)])
            elif family == "tool_request":
                text = _tool_prompt(rng)
            else:
                text = f"Write an SQL query that {SQL_TASKS[i % len(SQL_TASKS)]}."
            if text not in seen:
                seen.add(text)
                rows.append({"id": f"{family}/{i:04d}", "family": family,
                             "messages": [{"role": "user", "content": text}]})
        return rows
    # Functions whose body only raises or passes give empty tasks; the rest, in a seeded order.
    usable = [fn for fn in functions if not re.fullmatch(r"\s*(raise \w+(\(.*\))?|pass|return)\s*", fn["body"])]
    order = sorted(usable, key=lambda fn: stable_hash(f"{seed}:{family}:{fn['qualname']}"))
    for fn in order:
        if len(rows) == count:
            break
        text = _function_prompt(family, fn, random.Random(stable_hash(f"{seed}:{family}:{fn['qualname']}:ask")))
        if text is not None:
            rows.append({"id": f"{family}/{fn['qualname']}", "family": family,
                         "messages": [{"role": "user", "content": text}]})
    return rows


def make_prompts(seed: int = 0) -> dict:
    """{"train": [...], "held_out": [...]}: prompt rows in the `messages` dataset schema."""
    functions = collect_functions(stdlib_files())
    train_fns = [f for f in functions if not is_held_out(f["qualname"], HELD_OUT_SHARE)]
    held_fns = [f for f in functions if is_held_out(f["qualname"], HELD_OUT_SHARE)]
    train = [r for fam, n in TRAIN_FAMILIES.items() for r in _family_prompts(fam, n, train_fns, seed)]
    held = [r for fam, n in HELD_OUT_FAMILIES.items() for r in _family_prompts(fam, n, held_fns, seed)]
    return {"train": train, "held_out": held}
