"""The stand-in's prompts: general assistant chat for SmolLM2, the CPU stand-in for a public draft's data.

A public Kimi-K2.5 draft (lightseekorg/kimi-k2.5-eagle3) was trained on ~600K general samples that the
target regenerated; the user's own traffic is narrower (here: the coding-heavy set of
common/worlds/smollm2_prompts.py). To measure a warm start on the CPU, a stand-in draft is trained on a
different and larger distribution: these prompts, answered by SmolLM2 itself. No family here is a coding
family, none is one of the in-domain held-out families (to JavaScript, pytest tests, code review, SQL),
and every prompt differs from every in-domain prompt (tests check both). Families (general chat):
  explain    a topic to explain, in one of several asks
  how_to     an everyday task
  write      a short text of some form about a subject
  email      a short email for a purpose
  compare    the difference between two things
  rewrite    a sentence in another tone
  arithmetic a small word problem with numbers
  advice     tips for a goal
Subjects are split by a stable hash: HELD_OUT_SHARE of them only make held-out prompts (05 measures
forgetting on NUM_HELD_OUT of those, taken in turn from each family), the others only training prompts. Deterministic (no randomness besides the seed),
so the same module makes the same file on every machine.
"""
from __future__ import annotations

import hashlib
import random

TOPICS = ["photosynthesis", "the water cycle", "black holes", "the French Revolution", "vaccines", "inflation",
          "plate tectonics", "the immune system", "renewable energy", "the Roman Empire", "climate change",
          "the printing press", "gravity", "the stock market", "DNA", "volcanoes", "the moon landing",
          "supply and demand", "earthquakes", "the human heart", "rainbows", "the Silk Road", "bees",
          "the Industrial Revolution", "nutrition", "the solar system", "democracy", "sleep", "coral reefs",
          "the Renaissance", "tides", "electricity", "the Great Wall of China", "migration of birds",
          "compound interest", "the Olympic Games", "glaciers", "antibiotics", "the ozone layer", "jazz",
          "the Amazon rainforest", "magnets", "the Cold War", "recycling", "dinosaurs", "the brain",
          "hurricanes", "the alphabet", "coffee", "chess", "the internet", "deserts", "windmills", "honey",
          "the Nile", "seasons", "the metric system", "friction", "fossils", "bread baking", "mushrooms",
          "the pyramids of Giza", "sound waves", "trees", "the Moon's phases", "lightning", "tea",
          "the Vikings", "whales", "the periodic table", "mountains", "clouds", "bicycles", "maps",
          "the human skeleton", "money", "snow", "the ocean", "stars", "paper", "ants", "soap", "owls",
          "the Eiffel Tower", "photosynthesis in algae", "the Gold Rush", "octopuses", "the compass",
          "wind turbines", "the Aztecs", "penguins", "the telescope", "salt", "rivers", "the Mayan calendar",
          "spiders", "the steam engine", "wolves", "the Great Barrier Reef", "cheese making", "the rainforest canopy",
          "the Northern Lights", "elephants", "the telephone", "sunflowers", "the Sahara", "kites", "the piano",
          "the Ice Age", "camels", "the Statue of Liberty", "bamboo", "the postal service", "hot springs",
          "the Black Death", "lighthouses", "the Moon's craters", "pandas", "silk", "the abacus", "caves",
          "geysers", "the Wright brothers", "tulips", "the Mediterranean Sea", "frogs", "the calendar", "origami",
          "the Andes", "sharks", "glass", "the Vikings' ships", "hummingbirds", "the first cars"]
EXPLAIN_ASKS = ["Explain {x} to a beginner.", "What is {x}? Answer in a short paragraph.",
                "Give three interesting facts about {x}.", "Why is {x} important?",
                "Describe {x} as if I were ten years old.", "What are common misconceptions about {x}?",
                "Summarize what scientists or historians know about {x}.", "Tell me something surprising about {x}.",
                "How would you teach {x} in five minutes?"]
TASKS = ["boil an egg", "plant a tomato seedling", "fix a flat bicycle tire", "write a to-do list that works",
         "clean a cast iron pan", "fall asleep faster", "save money on groceries", "learn a new language",
         "prepare for a job interview", "start running as a beginner", "organize a small closet",
         "make a budget", "remove a coffee stain", "keep houseplants alive", "study for an exam",
         "make pancakes", "change a light bulb safely", "pack for a weekend trip", "write a thank-you note",
         "memorize a speech", "care for a cat", "reduce screen time", "brew green tea", "iron a shirt",
         "set up a home aquarium", "choose a good watermelon", "stretch after exercise", "sharpen a knife",
         "make a paper airplane", "read faster", "host a small dinner party", "sew a button",
         "build a campfire safely", "stay focused while working", "wash a wool sweater",
         "start a vegetable garden", "train a puppy to sit", "plan a birthday party", "make cold brew coffee",
         "wrap a gift neatly"]
FORMS = ["poem", "short story", "product description", "diary entry", "limerick", "news headline and summary",
         "motivational speech", "restaurant review", "travel postcard", "riddle", "haiku", "fairy tale opening",
         "song chorus", "letter to the editor", "two-line joke"]
SUBJECTS = ["a rainy afternoon", "a lost umbrella", "the first day of spring", "a lighthouse keeper",
            "a friendly robot", "an old library", "a mountain village", "a broken clock", "the city at night",
            "a stray dog", "a hot air balloon", "a forgotten garden", "a winter market", "a paper boat",
            "a busy kitchen", "an island", "a train journey", "a snowy forest", "a street musician",
            "a school play", "a sunflower field", "a thunderstorm", "a new neighbor", "a family recipe",
            "a desert night", "an empty stadium", "a fishing boat", "a birthday cake", "a secret door",
            "a long walk home"]
RECIPIENTS = ["my landlord", "a colleague", "my teacher", "a customer", "my manager", "a neighbor",
              "an old friend", "the hotel reception", "a supplier", "the city council"]
PURPOSES = ["asking to reschedule a meeting", "thanking them for their help", "reporting a broken heater",
            "apologizing for a late reply", "asking for a recommendation letter", "inviting them to a party",
            "requesting a refund", "announcing a change of address", "asking about opening hours",
            "following up on an earlier message", "declining an invitation politely", "asking for feedback"]
WORDS = ["ephemeral", "resilient", "meticulous", "serendipity", "candid", "frugal", "ubiquitous", "benevolent",
         "tenacious", "ambiguous", "nostalgia", "eloquent", "diligent", "vivid", "humble", "curious", "gregarious",
         "pragmatic", "whimsical", "obsolete", "tranquil", "robust", "spontaneous", "lenient", "cautious",
         "generous", "hesitant", "inevitable", "modest", "notorious", "optimistic", "peculiar", "reluctant",
         "sincere", "thrifty", "versatile", "wary", "zealous", "abundant", "brittle", "clumsy", "daring",
         "eager", "fragile", "graceful", "hollow", "idle", "jovial", "keen", "lavish", "mellow", "nimble",
         "obscure", "placid", "quaint", "radiant", "sturdy", "timid", "urgent", "vague"]
DISHES = ["tomato soup", "banana bread", "a green salad", "fried rice", "pancakes", "guacamole", "lentil stew",
          "an omelette", "hummus", "roasted vegetables", "porridge", "a fruit smoothie", "garlic bread",
          "potato salad", "vegetable curry", "lemonade", "chocolate chip cookies", "a tuna sandwich",
          "mashed potatoes", "pasta with tomato sauce", "apple crumble", "scrambled eggs", "rice pudding",
          "a bean burrito", "carrot cake", "pumpkin soup", "grilled cheese", "iced tea", "couscous salad",
          "baked apples"]
PLACES = ["Lisbon", "Kyoto", "Cape Town", "Vancouver", "Prague", "Marrakesh", "Reykjavik", "Buenos Aires",
          "Edinburgh", "Hanoi", "Vienna", "Sydney", "Istanbul", "Copenhagen", "Mexico City", "Florence",
          "Nairobi", "Singapore", "Dublin", "Quebec City"]
PAIRS = [("weather", "climate"), ("a virus", "a bacterium"), ("a lake", "a pond"), ("speed", "velocity"),
         ("a crocodile", "an alligator"), ("baking soda", "baking powder"), ("a frog", "a toad"),
         ("an ocean", "a sea"), ("a hurricane", "a tornado"), ("empathy", "sympathy"), ("a comet", "an asteroid"),
         ("a city", "a town"), ("a violin", "a viola"), ("jam", "jelly"), ("a moth", "a butterfly"),
         ("an epidemic", "a pandemic"), ("mass", "weight"), ("a rabbit", "a hare"), ("a cave", "a cavern"),
         ("a simile", "a metaphor"), ("a democracy", "a republic"), ("a hill", "a mountain"),
         ("a herb", "a spice"), ("a novel", "a novella"), ("fog", "mist"), ("a dolphin", "a porpoise"),
         ("a museum", "a gallery"), ("a loan", "a grant"), ("a canoe", "a kayak"), ("a bee", "a wasp")]
SENTENCES = ["I can't come to the meeting tomorrow.", "This soup is too salty.", "Send me the report now.",
             "The movie was boring.", "We need more chairs for the party.", "Your package arrived late.",
             "I forgot to call you back.", "The train was full again today.", "Please stop making noise.",
             "The price went up last week.", "I don't like this color.", "We lost the game.",
             "The printer is broken again.", "I will be there in ten minutes.", "The garden needs water.",
             "Nobody answered my question.", "The concert starts at eight.", "My phone battery died."]
TONES = ["formal", "friendly", "polite", "enthusiastic", "concise", "humorous", "reassuring"]
GOALS = ["drinking more water", "keeping a tidy desk", "making new friends in a new city", "waking up early",
         "eating more vegetables", "writing a first novel", "getting better at public speaking",
         "traveling on a small budget", "taking better photos with a phone", "keeping a journal",
         "learning to swim as an adult", "reading more books", "staying calm before an exam",
         "saving for a holiday", "being on time", "learning to draw", "walking ten thousand steps a day",
         "reducing food waste", "improving handwriting", "remembering names"]
GOODS = [("apple", "apples"), ("notebook", "notebooks"), ("bus ticket", "bus tickets"), ("loaf of bread", "loaves of bread"),
         ("pencil", "pencils"), ("cup of coffee", "cups of coffee"), ("flower pot", "flower pots"), ("egg", "eggs"),
         ("stamp", "stamps"), ("orange", "oranges"), ("candle", "candles"), ("postcard", "postcards")]
ARITHMETIC = ["One {one} costs {p} cents. How much do {n} {many} cost in dollars? Explain step by step.",
              "I have {m} dollars and one {one} costs {p} cents. How many {many} can I buy, and what change is left?",
              "A shop sold {n} {many} in the morning and {k} in the afternoon. How many {many} did it sell?"]
THINGS = ["working from home", "electric cars", "living in a big city", "owning a dog", "online shopping",
          "public transport", "homeschooling", "social media", "a four-day work week", "renting a flat",
          "buying a used car", "learning piano as an adult", "camping holidays", "a standing desk", "e-books",
          "living alone", "a gap year", "wearing a uniform at school", "cooking at home every day",
          "smart watches", "group projects", "open-plan offices", "cash payments", "early retirement",
          "studying abroad", "a vegetarian diet", "solar panels at home", "night shifts", "tiny houses",
          "video calls instead of meetings", "having a garden", "city bikes", "audiobooks", "cruise holidays",
          "a big wedding", "freelancing", "self-driving cars", "board games", "houseboats", "daylight saving time"]
FAMILIES = ("explain", "how_to", "write", "email", "compare", "rewrite", "arithmetic", "advice", "define", "recipe",
            "travel", "pros_cons")
HELD_OUT_SHARE = 0.06
NUM_HELD_OUT = 120   # as many as the in-domain held-out set; taken in turn from each family


def held_out(subject: str) -> bool:
    """A subject's split, by a stable hash (the same on every machine and Python)."""
    return int(hashlib.sha256(subject.encode()).hexdigest()[:8], 16) / 2 ** 32 < HELD_OUT_SHARE


def _family(family: str, rng: random.Random) -> list[tuple[str, str]]:
    """Every (subject, prompt) of a family; the subject decides the split."""
    if family == "explain":
        return [(t, a.format(x=t)) for t in TOPICS for a in EXPLAIN_ASKS]
    if family == "how_to":
        return [(t, q.format(t=t)) for t in TASKS for q in ("How do I {t}?", "What is the easiest way to {t}?",
                                                             "Give me step-by-step instructions to {t}.",
                                                             "What mistakes do beginners make when they {t}?",
                                                             "My friend wants to {t}. What should I tell them?")]
    if family == "write":
        return [(s, f"Write a {f} about {s}.") for s in SUBJECTS for f in FORMS]
    if family == "email":
        return [(p, f"Write a brief email to {r} {p}.") for p in PURPOSES for r in RECIPIENTS]
    if family == "compare":
        return [(a, q.format(a=a, b=b)) for a, b in PAIRS for q in ("What is the difference between {a} and {b}?",
                                                                    "How can I tell {a} from {b}?",
                                                                    "Is {a} more like {b} than people think?")]
    if family == "rewrite":
        return [(s, f'Rewrite this sentence to sound more {t}: "{s}"') for s in SENTENCES for t in TONES]
    if family == "arithmetic":
        out = []
        for one, many in GOODS:
            for _ in range(14):
                for template in ARITHMETIC:
                    n, k, p, m = rng.randint(3, 19), rng.randint(2, 30), rng.randint(2, 60), rng.randint(2, 20)
                    out.append((one, template.format(one=one, many=many, n=n, k=k, p=p, m=m)))
        return out
    if family == "define":
        return [(w, q.format(w=w)) for w in WORDS for q in ("What does the word '{w}' mean? Use it in a sentence.",
                                                           "Give two synonyms and one antonym of '{w}'.",
                                                           "Write a short sentence about the weather with the word '{w}'.")]
    if family == "recipe":
        return [(d, q.format(d=d)) for d in DISHES for q in ("Give me a simple recipe for {d}.",
                                                            "What do I need to make {d}, and how long does it take?",
                                                            "How can I make {d} healthier?")]
    if family == "travel":
        return [(c, q.format(c=c, n=n)) for c in PLACES for n in (2, 3, 5)
                for q in ("Plan a {n}-day trip to {c}.", "What should I pack for {n} days in {c}?")]
    if family == "pros_cons":
        return [(t, q.format(t=t)) for t in THINGS for q in ("What are the pros and cons of {t}?",
                                                            "Would you recommend {t}? Give reasons for and against.",
                                                            "Write a balanced paragraph about {t}.")]
    assert family == "advice", family
    return [(g, q.format(g=g)) for g in GOALS for q in ("What are some tips for {g}?",
                                                        "I struggle with {g}. What should I try first?",
                                                        "Make a one-week plan for {g}.",
                                                        "Why do people find {g} hard?")]


def make_prompts(seed: int = 0) -> dict:
    """{"train": [...], "heldout": [...]}: rows {"id": "<family>/NNNN", "family", "messages": [user]}, unique
    prompt texts, ids in family order."""
    rng = random.Random(seed)
    out = {"train": [], "heldout": []}
    seen = set()
    for family in FAMILIES:
        counts = {"train": 0, "heldout": 0}
        for subject, text in _family(family, rng):
            if text in seen:
                continue
            seen.add(text)
            split = "heldout" if held_out(subject) else "train"
            out[split].append({"id": f"general_{family}/{counts[split]:04d}" + ("h" if split == "heldout" else ""),
                               "family": family, "messages": [{"role": "user", "content": text}]})
            counts[split] += 1
    out["heldout"] = _round_robin(out["heldout"])[:NUM_HELD_OUT]
    return out


def _round_robin(rows: list[dict]) -> list[dict]:
    """Rows taken in turn from each family (each in its order), so a prefix covers every family."""
    rank, seen = {}, {}
    for r in rows:
        rank[r["id"]] = seen.get(r["family"], 0)
        seen[r["family"]] = rank[r["id"]] + 1
    return sorted(rows, key=lambda r: (rank[r["id"]], FAMILIES.index(r["family"])))
