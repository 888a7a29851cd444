"""Generate the tiny offline demo dataset shipped in ``data/tiny/``.

All data here is synthetic: it is built from hand-written templates for this
project (rlhf_cli) and contains no scraped or third-party text. It is released
under CC0.

The data encodes ONE preference that tiny models can learn:

    polite, helpful replies are preferred over curt, dismissive ones.

A polite reply is a friendly opener, then either the topic's one-sentence useful
answer or its short gist ("Of course! Just boil it. Good luck!"), and often a
friendly sign-off. A dismissive reply is either a short brush-off ("Not my
problem.", "Whatever, just boil it.") or the same useful answer wrapped in rude
words ("Ugh, fine. Place it in boiling water ... Now stop asking."). Both styles
come long and short, so that length says nothing about which reply is preferred:
the chosen reply is the longer in about half the pairs. (Until 2026-12, every
chosen reply was the longer, and the reward model trained on them scored length,
not tone: a long rude reply outscored a short polite one, and PPO's gain on it
was invisible to any judge of tone; issue #51.) Wording is varied (many topics,
openers, sign-offs and rude phrasings) so that a reward model learns tone rather
than one fixed string.

Files written (JSON Lines unless noted):

* ``sft.jsonl``          {"prompt", "response"}; half polite, half dismissive,
                         so the SFT policy can produce both styles and PPO has
                         room to move toward the polite one.
* ``preferences.jsonl``  {"prompt", "chosen", "rejected"}; chosen is always
                         the polite reply.
* ``prompts.jsonl``      {"prompt"} for PPO rollouts. Built from a second
                         question phrasing per topic, so no PPO prompt string
                         occurs in preferences.jsonl (the reward model and the
                         policy are not trained on the same prompts).
* ``audit_prompts.txt``  5 extra prompts, one per line, on topics not in the
                         table and not in any other file.
* ``README.md``          short description of the files.

Run from the repository root:  python scripts/make_tiny_data.py
Output is deterministic (random.Random(0)); stdlib only.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent.parent / "data" / "tiny"

N_SFT = 400
N_PREFS = 400
N_PPO = 200
MAX_RESPONSE_WORDS = 25
MAX_PROMPT_CHARS = 200
MIN_PROMPT_WORDS = 6  # the pipeline drops prompts of 5 words or fewer

# ---------------------------------------------------------------------------
# Topic table: (question A, question B, helpful one-sentence answer, curt gist)
#
# Question A is used for preferences.jsonl, question B for prompts.jsonl (PPO);
# sft.jsonl uses both. The gist fills rude templates like "Whatever, just {}."
# ---------------------------------------------------------------------------
TOPICS = [
    (
        "How do I boil an egg properly?",
        "What is the best way to hard boil eggs?",
        "To boil an egg, place it in boiling water for nine minutes, then cool it in cold water.",
        "boil it",
    ),
    (
        "How do I cook white rice on the stove?",
        "What is the right way to make fluffy rice?",
        "Rinse one cup of rice, then simmer it covered in two cups of water for about eighteen minutes.",
        "add water and heat it",
    ),
    (
        "How should I make a good cup of tea?",
        "What is the best way to brew black tea?",
        "Pour freshly boiled water over the tea bag and let it steep for three to five minutes.",
        "add hot water",
    ),
    (
        "How do I make coffee with a French press?",
        "What is the method for French press coffee?",
        "Add coarse ground coffee, pour in hot water, wait four minutes, then press the plunger down slowly.",
        "press it",
    ),
    (
        "How can I fall asleep faster at night?",
        "Do you have any tips for sleeping better?",
        "Keep a regular bedtime, avoid screens for an hour before bed, and keep your room cool and dark.",
        "go to bed",
    ),
    (
        "How often should I water my houseplants?",
        "What is a good watering schedule for indoor plants?",
        "Water most houseplants when the top few centimetres of soil feel dry, usually about once a week.",
        "water them",
    ),
    (
        "How do I get a coffee stain out of a shirt?",
        "What is the best way to remove coffee stains from clothes?",
        "Rinse the stain with cold water, rub in a little dish soap, then wash the shirt as usual.",
        "wash it",
    ),
    (
        "Can you explain how to tie a tie?",
        "What are the steps for tying a simple tie knot?",
        "Wrap the wide end around the narrow end, pull it up through the neck loop, then down through the knot.",
        "tie it",
    ),
    (
        "How do I fix a flat tire on my bike?",
        "What should I do to patch a bicycle inner tube?",
        "Remove the tube, find the hole, roughen the spot with sandpaper, and apply a patch with glue.",
        "patch it",
    ),
    (
        "How can I start saving more money each month?",
        "What is a simple way to save money regularly?",
        "Set up an automatic transfer of a fixed amount to a savings account right after each payday.",
        "spend less",
    ),
    (
        "What is a good way to learn a new language?",
        "How should I start learning Spanish at home?",
        "Practise a little every day, learn common phrases first, and listen to native speakers often.",
        "study",
    ),
    (
        "What can I do about a mild headache?",
        "How can I get rid of a small headache quickly?",
        "Drink a glass of water, rest in a quiet dark room, and take a standard pain reliever if needed.",
        "take a pill",
    ),
    (
        "How do I clean the inside of my oven?",
        "What is an easy way to clean a dirty oven?",
        "Spread a paste of baking soda and water inside, leave it overnight, then wipe it off with a damp cloth.",
        "scrub it",
    ),
    (
        "How do I jump start a car battery?",
        "What are the steps to jump start a dead car?",
        "Connect the cables red to red and black to bare metal, then start the working car before the dead one.",
        "use cables",
    ),
    (
        "How much water should I drink each day?",
        "What is a healthy amount of water per day?",
        "Most adults do well with about eight glasses a day, and more when it is hot or you exercise.",
        "drink some",
    ),
    (
        "How can I make my resume look better?",
        "What are some tips for writing a good resume?",
        "Keep it to one page, start each point with a strong verb, and show results with numbers.",
        "rewrite it",
    ),
    (
        "How should I prepare for a job interview?",
        "What can I do to get ready for an interview?",
        "Research the company, practise answers to common questions aloud, and prepare two questions to ask them.",
        "show up",
    ),
    (
        "How do I bake a simple loaf of bread?",
        "What is an easy recipe for homemade bread?",
        "Mix flour, water, yeast and salt, let the dough rise for an hour, then bake it for thirty minutes.",
        "bake it",
    ),
    (
        "How should a beginner start running regularly?",
        "What is a good way to begin jogging?",
        "Start with short runs mixed with walking three times a week, and increase the distance slowly.",
        "run",
    ),
    (
        "How can I make my phone battery last longer?",
        "What helps a phone battery last all day?",
        "Lower the screen brightness, close apps you are not using, and turn off location when you do not need it.",
        "charge it",
    ),
    (
        "How do I write a polite professional email?",
        "What should a good work email include?",
        "Use a clear subject line, greet the person by name, state your request briefly, and thank them.",
        "type it",
    ),
    (
        "What is the fastest way to peel garlic?",
        "How can I peel garlic cloves more easily?",
        "Press each clove with the flat side of a knife and the skin will slip right off.",
        "peel it",
    ),
    (
        "How do I clean a cast iron pan?",
        "What is the right way to wash cast iron?",
        "Scrub it with hot water and a brush, dry it fully, then rub in a thin layer of oil.",
        "rinse it",
    ),
    (
        "How can I get rid of the hiccups?",
        "What is a good trick to stop hiccups?",
        "Hold your breath for about ten seconds, or slowly sip a glass of cold water.",
        "hold your breath",
    ),
    (
        "What helps stop a mosquito bite from itching?",
        "How can I calm an itchy bug bite?",
        "Wash the bite, apply a cold compress, and use a little anti-itch cream instead of scratching.",
        "stop scratching",
    ),
    (
        "How should I study for an exam next week?",
        "What is a good plan for exam revision?",
        "Study in short daily sessions, test yourself with practice questions, and sleep well the night before.",
        "study harder",
    ),
    (
        "Why is my home wifi so slow sometimes?",
        "How can I speed up my home wifi?",
        "Restart the router, move it to a central open spot, and keep it away from thick walls and microwaves.",
        "restart it",
    ),
    (
        "How can I speed up my slow laptop?",
        "What should I do when my computer runs slowly?",
        "Close unused programs, remove startup apps you do not need, and restart it at least once a week.",
        "turn it off and on",
    ),
    (
        "How do I create a strong password?",
        "What makes a password hard to guess?",
        "Use a long phrase of four or more random words, and never reuse it on other sites.",
        "make one up",
    ),
    (
        "How long should I cook dried pasta?",
        "What is the right way to cook spaghetti?",
        "Boil it in plenty of salted water for the time on the packet, usually about ten minutes.",
        "boil it",
    ),
    (
        "How can I tell if an avocado is ripe?",
        "What is the best way to check an avocado?",
        "A ripe avocado gives slightly when you press it gently, and it looks green under the stem.",
        "squeeze it",
    ),
    (
        "What are some ways to reduce everyday stress?",
        "How can I feel less stressed at work?",
        "Take short breaks, go for a walk outside, and try a few minutes of slow deep breathing.",
        "relax",
    ),
    (
        "How should I pack for moving house?",
        "What is the best way to pack boxes for a move?",
        "Pack one room at a time, put heavy items in small boxes, and label every box with its room.",
        "put it in boxes",
    ),
    (
        "How do I paint a wall in my room?",
        "What are the steps for painting an interior wall?",
        "Clean the wall, tape the edges, apply primer, then roll on two thin coats of paint.",
        "paint it",
    ),
    (
        "How do I hang a picture on the wall?",
        "What is the right way to hang a picture frame?",
        "Mark the height at eye level, put in a nail or hook at a slight angle, and level the frame.",
        "use a nail",
    ),
    (
        "How can I unclog a slow kitchen drain?",
        "What is a simple way to clear a blocked drain?",
        "Pour in baking soda and then vinegar, wait fifteen minutes, and flush it with hot water.",
        "use a plunger",
    ),
    (
        "How often should I walk my dog?",
        "How much exercise does a dog need?",
        "Most dogs need at least two walks a day of about thirty minutes, depending on breed and age.",
        "walk it",
    ),
    (
        "How do I stop my cat scratching the sofa?",
        "What can I do about my cat scratching furniture?",
        "Put a sturdy scratching post next to the sofa and reward your cat with treats when it uses it.",
        "buy a post",
    ),
    (
        "How do I make a simple monthly budget?",
        "What is an easy way to plan a budget?",
        "List your income, subtract fixed bills, then set spending limits for food, transport and fun.",
        "write it down",
    ),
    (
        "How can I get better at public speaking?",
        "What helps with nerves before giving a speech?",
        "Practise out loud several times, learn your first minute by heart, and breathe slowly before you start.",
        "just talk",
    ),
    (
        "How do I grow tomatoes in my garden?",
        "What do tomato plants need to grow well?",
        "Plant them in full sun, water deeply a few times a week, and tie the stems to stakes.",
        "plant them",
    ),
    (
        "How do I start a compost pile at home?",
        "What can I put in a home compost bin?",
        "Mix green scraps like vegetable peels with brown material like dry leaves, and turn the pile weekly.",
        "throw scraps in",
    ),
    (
        "How do I iron a shirt without creases?",
        "What is the best way to iron a dress shirt?",
        "Iron the collar first, then the cuffs and sleeves, and finish with the body while it is slightly damp.",
        "iron it",
    ),
    (
        "How can I stop my shoes from smelling?",
        "What gets rid of bad smells in shoes?",
        "Sprinkle baking soda inside overnight, let them dry fully, and wear clean cotton socks.",
        "wash them",
    ),
    (
        "How can I cut onions without crying?",
        "What stops my eyes watering when chopping onions?",
        "Chill the onion for fifteen minutes first and use a very sharp knife so less juice escapes.",
        "cut it",
    ),
    (
        "What should I do with a small cut on my finger?",
        "How do I treat a minor cut at home?",
        "Rinse it with clean water, press gently to stop the bleeding, then cover it with a bandage.",
        "put a plaster on",
    ),
    (
        "What can I do to soothe a mild sunburn?",
        "How should I treat sunburn on my shoulders?",
        "Cool the skin with a damp cloth, apply aloe vera gel, and drink plenty of water.",
        "stay inside",
    ),
    (
        "How can I remember people's names better?",
        "What is a trick for remembering new names?",
        "Repeat the name out loud when you meet someone, and link it to a picture in your mind.",
        "pay attention",
    ),
    (
        "How can I stop putting off my work?",
        "What helps when I keep procrastinating on tasks?",
        "Break the task into small steps and work on the first one for just five minutes.",
        "do it",
    ),
    (
        "How do I start meditating as a beginner?",
        "What is a simple way to try meditation?",
        "Sit comfortably, set a timer for five minutes, and gently bring your attention back to your breath.",
        "sit still",
    ),
    (
        "How often should I change my car's oil?",
        "When should I get an oil change for my car?",
        "Most modern cars need new oil every eight to sixteen thousand kilometres, so check your owner's manual.",
        "check the manual",
    ),
    (
        "How do I check my car tire pressure?",
        "What is the way to check tire pressure at home?",
        "Remove the valve cap, press a tire gauge onto the valve, and compare it to the sticker on the door.",
        "use a gauge",
    ),
    (
        "How do I make fluffy pancakes from scratch?",
        "What is a simple recipe for breakfast pancakes?",
        "Whisk flour, milk, an egg, baking powder and a pinch of salt, then cook small scoops in a hot pan.",
        "fry them",
    ),
    (
        "How can I keep bread fresh for longer?",
        "What is the best way to store bread?",
        "Keep it in a paper bag at room temperature for two days, or slice and freeze it for longer.",
        "freeze it",
    ),
    (
        "How do I fold a fitted sheet neatly?",
        "What is the trick to folding a fitted sheet?",
        "Tuck the corners into each other, lay it flat, fold the edges into a rectangle, then fold it up.",
        "fold it",
    ),
    (
        "How can I take better photos with my phone?",
        "What are some tips for phone photography?",
        "Clean the lens, use natural light from a window, and tap the screen to focus on your subject.",
        "point and shoot",
    ),
    (
        "How should I back up my computer files?",
        "What is a good way to back up my photos?",
        "Keep one copy on an external drive and another in a cloud service, and update both every week.",
        "copy them",
    ),
    (
        "How do I take a screenshot on Windows?",
        "What is the shortcut for a screenshot on Windows?",
        "Press the Windows key, Shift and S together, then drag to select the part of the screen you want.",
        "press a button",
    ),
    (
        "What can I do for mild lower back pain?",
        "How can I ease a stiff lower back?",
        "Keep moving gently, try light stretches like knee to chest, and use a warm pack for twenty minutes.",
        "lie down",
    ),
    (
        "What is a quick and healthy breakfast idea?",
        "Can you suggest a healthy breakfast before work?",
        "Try oats with milk, a sliced banana and a spoon of nuts; it takes about five minutes.",
        "eat something",
    ),
    (
        "How do I start meal prepping for the week?",
        "What is an easy way to prepare weekly meals?",
        "Pick three simple recipes, cook them in large batches on Sunday, and store portions in labelled boxes.",
        "cook more",
    ),
    (
        "How do I write a thank you note?",
        "What should I say in a thank you card?",
        "Thank them for the specific gift or favour, say how you will use it, and end with a warm wish.",
        "say thanks",
    ),
    (
        "How do I apologise to a friend properly?",
        "What is a good way to say sorry to someone?",
        "Say clearly what you did wrong, admit how it affected them, and explain what you will do differently.",
        "say sorry",
    ),
    (
        "How do I remove sticky label residue from glass?",
        "What gets sticker glue off a jar?",
        "Rub a little cooking oil on the residue, wait ten minutes, then wipe it off with warm soapy water.",
        "scrape it",
    ),
    (
        "How do I defrost chicken safely at home?",
        "What is the safe way to thaw frozen chicken?",
        "Thaw it in the fridge overnight, or seal it in a bag and soak it in cold water.",
        "wait",
    ),
    (
        "How do I get candle wax off a tablecloth?",
        "What removes dripped candle wax from fabric?",
        "Scrape off what you can, lay a paper towel over it, and press it with a warm iron.",
        "pick it off",
    ),
    (
        "How can I open a jar lid that is stuck?",
        "What is a trick for opening a tight jar?",
        "Run the lid under hot water for thirty seconds, then grip it with a rubber glove and twist.",
        "twist harder",
    ),
    (
        "How can I read more books each year?",
        "What helps build a daily reading habit?",
        "Keep a book with you, read ten pages before bed, and choose books you genuinely enjoy.",
        "read",
    ),
    (
        "How can I deal with jet lag after travel?",
        "What helps me recover from jet lag faster?",
        "Switch to the local schedule right away, get morning sunlight, and avoid long naps on the first day.",
        "sleep it off",
    ),
    (
        "How should I pack a suitcase for a trip?",
        "What is the best way to pack light for travel?",
        "Roll your clothes, pick outfits that mix and match, and put liquids in a small clear bag.",
        "throw stuff in",
    ),
    (
        "How do I sharpen a kitchen knife at home?",
        "What is the right way to sharpen a knife?",
        "Hold the blade at about twenty degrees on a whetstone and draw it across evenly on both sides.",
        "sharpen it",
    ),
    (
        "How can an adult learn to swim?",
        "What is the best way to start swimming lessons?",
        "Take a beginner class at a local pool, start in shallow water, and practise floating and breathing first.",
        "get in the water",
    ),
    (
        "How can I make new friends in a new city?",
        "What is a good way to meet people after moving?",
        "Join a club or class for a hobby you enjoy, and go regularly so you see the same faces.",
        "go outside",
    ),
    (
        "How do I get rid of fruit flies in my kitchen?",
        "What is a simple trap for fruit flies?",
        "Fill a small bowl with cider vinegar and a drop of dish soap, and the flies will sink in it.",
        "swat them",
    ),
    (
        "What can I do to soothe a sore throat?",
        "How can I ease a scratchy sore throat?",
        "Gargle with warm salt water, drink warm tea with honey, and rest your voice.",
        "drink water",
    ),
]

# Optional lead-ins that multiply each question into several prompt strings.
# (text, lowercase the question's first letter after it?)
PROMPT_PREFIXES = [
    ("", False),
    ("Hi! ", False),
    ("Hello, ", True),
    ("Quick question: ", False),
    ("Hey, ", True),
    ("Can you help me? ", False),
    ("I was wondering, ", True),
]

# Five prompts for the audit, on topics that are in no other file.
AUDIT_PROMPTS = [
    "How can I keep cut flowers fresh for longer?",
    "What is a good way to clean my glasses without scratching them?",
    "How do I get my toddler to eat more vegetables?",
    "What should I do when my car windshield fogs up?",
    "How can I stop my bike chain from squeaking?",
]

# ---------------------------------------------------------------------------
# Style pieces
# ---------------------------------------------------------------------------
POLITE_OPENERS = [
    "Happy to help!",
    "Great question!",
    "Sure thing!",
    "Of course!",
    "Good question!",
    "I'd be glad to help.",
    "Thanks for asking!",
    "Absolutely!",
    "Sure, here's how.",
    "Certainly!",
    "Glad you asked!",
    "No problem at all!",
    "Here's a simple way.",
    "I can help with that.",
    "Good thinking to ask!",
    "Of course, happy to explain.",
    "What a nice question!",
    "Sure, I'd love to help.",
]

POLITE_CLOSERS = [
    "Hope that helps!",
    "Good luck!",
    "Enjoy!",
    "Have a great day!",
    "Feel free to ask more.",
    "Hope this is useful!",
    "Take care!",
    "Best of luck!",
    "You've got this!",
    "Let me know if you need more.",
    "Happy to help anytime!",
    "Thanks for asking!",
]
P_CLOSER = 0.65  # chance a polite reply ends with a sign-off (if it fits)

# Dismissive replies that need no topic.
RUDE_GENERIC = [
    "Not my problem.",
    "Look it up yourself.",
    "Figure it out yourself.",
    "Ask someone else.",
    "Why would I know that?",
    "Do I look like I care?",
    "Google it.",
    "Not my job.",
    "That is a dumb question.",
    "I can't be bothered.",
    "Stop asking me things.",
    "Who cares?",
    "Go away.",
    "Use your head.",
    "No. Next question.",
    "Not worth my time.",
    "Read the manual.",
    "Seriously? Work it out.",
    "Ugh, no.",
    "Don't bother me with this.",
    "Everyone knows that.",
    "Whatever.",
    "Leave me alone.",
    "How is that my concern?",
    "Not doing this today.",
    "Find out on your own.",
    # a few longer ones, so length alone does not separate the two styles
    "Figure it out yourself. I'm not here to answer every little question you have.",
    "Honestly, I don't care. Go ask somebody who has the time for this.",
    "Why do you always ask me? Look it up yourself and stop wasting my time.",
]

# Dismissive templates that mention the topic's gist ("{g}" / "{G}").
RUDE_TEMPLATES = [
    "Whatever, just {g}.",
    "Figure it out yourself. Just {g}.",
    "Ugh. Just {g}.",
    "Just {g}. Obviously.",
    "{G}. Done. Stop asking.",
    "Just {g} and leave me alone.",
    "It's not hard. {G}.",
    "Come on, just {g}.",
    "Seriously? {G}.",
    "{G}. Why ask me?",
    "Just {g}. Not my problem.",
    "{G} or don't, I don't care.",
    "Look it up. Or just {g}.",
    "You {g}. Everyone knows that.",
]
P_RUDE_TEMPLATE = 0.5  # chance a short rude reply uses the topic gist

# The useful answer wrapped in rude words: as long as a polite reply, as dismissive as a short one.
RUDE_OPENERS = [
    "Ugh, fine.",
    "Seriously? Fine.",
    "Whatever.",
    "Obviously,",
    "Do I have to? Fine.",
    "Not my job, but fine.",
    "Wow, everyone knows this.",
    "Ugh.",
]
RUDE_CLOSERS = [
    "Now stop asking.",
    "Don't bother me again.",
    "Leave me alone.",
    "Figure out the rest yourself.",
    "Was that so hard?",
    "Next time google it.",
]
P_LONG = 0.5  # chance a reply (either style) carries the full answer rather than the gist


def n_words(text: str) -> int:
    return len(text.split())


def make_prompt(question: str, prefix: tuple[str, bool]) -> str:
    text, lower = prefix
    if lower:
        question = question[0].lower() + question[1:]
    return text + question


def polite_reply(rng: random.Random, answer: str) -> str:
    openers = [o for o in POLITE_OPENERS if n_words(o) + n_words(answer) <= MAX_RESPONSE_WORDS]
    if not openers:
        raise ValueError(f"answer too long for any opener: {answer!r}")
    reply = f"{rng.choice(openers)} {answer}"
    if rng.random() < P_CLOSER:
        closers = [c for c in POLITE_CLOSERS if n_words(reply) + n_words(c) <= MAX_RESPONSE_WORDS]
        if closers:
            reply = f"{reply} {rng.choice(closers)}"
    return reply


def polite_short_reply(rng: random.Random, gist: str) -> str:
    reply = f"{rng.choice(POLITE_OPENERS)} Just {gist}."
    return f"{reply} {rng.choice(POLITE_CLOSERS)}" if rng.random() < P_CLOSER else reply


def rude_long_reply(rng: random.Random, answer: str) -> str:
    """The useful answer between a rude opener and (as often as a polite reply's sign-off) a rude
    closer, within the polite replies' word limit."""
    openers = [o for o in RUDE_OPENERS if n_words(o) + n_words(answer) <= MAX_RESPONSE_WORDS]
    opener = rng.choice(openers)
    body = answer[0].lower() + answer[1:] if opener.endswith(",") else answer
    reply = f"{opener} {body}"
    if rng.random() < P_CLOSER:
        closers = [c for c in RUDE_CLOSERS if n_words(reply) + n_words(c) <= MAX_RESPONSE_WORDS]
        if closers:
            reply = f"{reply} {rng.choice(closers)}"
    return reply


def reply(rng: random.Random, style: str, answer: str, gist: str) -> str:
    """A reply in `style` (polite or rude), carrying the full answer or the gist (P_LONG)."""
    long = rng.random() < P_LONG
    if style == "polite":
        return polite_reply(rng, answer) if long else polite_short_reply(rng, gist)
    return rude_long_reply(rng, answer) if long else rude_reply(rng, gist)


def rude_reply(rng: random.Random, gist: str) -> str:
    if rng.random() < P_RUDE_TEMPLATE:
        template = rng.choice(RUDE_TEMPLATES)
        return template.format(g=gist, G=gist[0].upper() + gist[1:])
    return rng.choice(RUDE_GENERIC)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def build(rng: random.Random) -> dict[str, list]:
    # Every (topic, question, prefix) combination, split by phrasing.
    pref_pool = []  # question A -> preferences
    ppo_pool = []  # question B -> PPO prompts
    for idx, (q_a, q_b, _answer, _gist) in enumerate(TOPICS):
        for prefix in PROMPT_PREFIXES:
            pref_pool.append((idx, make_prompt(q_a, prefix)))
            ppo_pool.append((idx, make_prompt(q_b, prefix)))

    # preferences.jsonl: distinct prompts, chosen always polite.
    prefs = []
    for idx, prompt in rng.sample(pref_pool, N_PREFS):
        _, _, answer, gist = TOPICS[idx]
        prefs.append(
            {
                "prompt": prompt,
                "chosen": reply(rng, "polite", answer, gist),
                "rejected": reply(rng, "rude", answer, gist),
            }
        )

    # prompts.jsonl: distinct prompts from the other phrasing.
    ppo = [{"prompt": prompt} for _, prompt in rng.sample(ppo_pool, N_PPO)]

    # sft.jsonl: both phrasings, exactly half polite and half dismissive.
    sft_pool = pref_pool + ppo_pool
    styles = ["polite"] * (N_SFT // 2) + ["rude"] * (N_SFT - N_SFT // 2)
    rng.shuffle(styles)
    sft = []
    for (idx, prompt), style in zip(rng.sample(sft_pool, N_SFT), styles):
        _, _, answer, gist = TOPICS[idx]
        response = reply(rng, style, answer, gist)
        sft.append({"prompt": prompt, "response": response})

    return {"sft": sft, "prefs": prefs, "ppo": ppo, "audit": list(AUDIT_PROMPTS)}


def check(data: dict[str, list]) -> None:
    sft, prefs, ppo, audit = data["sft"], data["prefs"], data["ppo"], data["audit"]
    assert len(sft) == N_SFT and len(prefs) == N_PREFS and len(ppo) == N_PPO and len(audit) == 5

    all_prompts = [r["prompt"] for r in sft + prefs + ppo] + audit
    for p in all_prompts:
        assert n_words(p) >= MIN_PROMPT_WORDS, f"prompt too short: {p!r}"
        assert len(p) < MAX_PROMPT_CHARS, f"prompt too long: {p!r}"
        assert "\n" not in p

    pref_prompts = {r["prompt"] for r in prefs}
    ppo_prompts = {r["prompt"] for r in ppo}
    assert not (pref_prompts & ppo_prompts), "PPO prompts overlap preferences"
    assert len(ppo_prompts) == N_PPO, "duplicate PPO prompts"
    assert not set(audit) & (pref_prompts | ppo_prompts | {r["prompt"] for r in sft})

    polite = set(POLITE_OPENERS)
    for r in prefs:
        assert any(r["chosen"].startswith(o) for o in polite)
        assert not any(r["rejected"].startswith(o) for o in polite)
    longer = sum(n_words(r["chosen"]) > n_words(r["rejected"]) for r in prefs) / len(prefs)
    assert 0.35 < longer < 0.65, f"length predicts the preference: chosen longer in {longer:.0%}"
    for r in sft:
        assert n_words(r["response"]) <= MAX_RESPONSE_WORDS, r["response"]
    n_polite = sum(any(r["response"].startswith(o) for o in polite) for r in sft)
    assert n_polite == N_SFT // 2, n_polite


README = """\
# Tiny demo dataset

Synthetic data for the offline demo of `rlhf_cli`, written for this project
from templates (no scraped or third-party text). License: CC0 1.0 (public domain).

It encodes one preference: polite, helpful replies are preferred over curt,
dismissive ones. {n_topics} everyday topics, each with two question phrasings and
a one-sentence helpful answer.

| file | rows | content |
|---|---|---|
| `sft.jsonl` | {n_sft} | `{{"prompt", "response"}}`, half polite, half dismissive, each style long (the full answer) or short (its gist) |
| `preferences.jsonl` | {n_prefs} | `{{"prompt", "chosen", "rejected"}}`, chosen is always the polite reply; it is the longer in about half the pairs |
| `prompts.jsonl` | {n_ppo} | `{{"prompt"}}` for PPO rollouts; none of these prompt strings occurs in `preferences.jsonl` |
| `audit_prompts.txt` | {n_audit} | extra prompts, one per line, on topics not in the other files |

Regenerate (deterministic, stdlib only): `python scripts/make_tiny_data.py`
"""


def main() -> None:
    rng = random.Random(0)
    data = build(rng)
    check(data)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    write_jsonl(OUT_DIR / "sft.jsonl", data["sft"])
    write_jsonl(OUT_DIR / "preferences.jsonl", data["prefs"])
    write_jsonl(OUT_DIR / "prompts.jsonl", data["ppo"])
    (OUT_DIR / "audit_prompts.txt").write_text("\n".join(data["audit"]) + "\n", encoding="utf-8")
    (OUT_DIR / "README.md").write_text(
        README.format(
            n_topics=len(TOPICS),
            n_sft=len(data["sft"]),
            n_prefs=len(data["prefs"]),
            n_ppo=len(data["ppo"]),
            n_audit=len(data["audit"]),
        ),
        encoding="utf-8",
    )
    print(
        f"wrote {OUT_DIR}: sft={len(data['sft'])} preferences={len(data['prefs'])} "
        f"prompts={len(data['ppo'])} audit={len(data['audit'])} topics={len(TOPICS)}"
    )


if __name__ == "__main__":
    main()
