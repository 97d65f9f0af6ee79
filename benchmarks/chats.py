"""Twenty everyday multi-turn conversations, ten user turns each, and their rendering with a
model's chat template: the workload of ``benchmarks/multiturn.py``.

The user messages (10 to 60 words) are written as people write to a chat assistant: each one
follows on from the turn before (cooking, travel, code help, history, health, writing help, ...).
The assistant's replies are not here: they are whatever the model answers, so a turn is
rendered from the replies the model gave to the turns before it::

    from chats import CHATS, render, tokenizer     # benchmarks/ is the script's folder
    tok = tokenizer(model_dir)
    tokens = render(tok, CHATS[0], 0, [])          # turn 1: system prompt + first user message
    tokens = render(tok, CHATS[0], 1, [reply_1])   # turn 2: ... + reply 1 + second user message

Plain data and small functions; transformers is imported only by :func:`tokenizer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

SYSTEM = (
    "You are a helpful, friendly assistant. Answer clearly and briefly, give practical "
    "steps where they help, and ask a short question back when a request is unclear."
)
"""The system prompt every conversation starts with."""


class Chat(NamedTuple):
    """One conversation: its topic (a label) and the user's messages, in order."""

    topic: str
    turns: tuple[str, ...]


CHATS: tuple[Chat, ...] = (
    Chat(
        "cooking",
        (
            (
                "I'm hosting a dinner party for eight on Saturday and want to make lasagna from scratch. I work "
                "until six on Friday, so most of the cooking has to happen Friday evening or Saturday morning. "
                "Can you give me a rough plan?"
            ),
            (
                "Should I make fresh pasta sheets or are the dried no-boil ones fine? I've never made pasta before "
                "and I'm a bit nervous about it."
            ),
            "Okay, dried it is. For the meat sauce, is it better with beef only or a mix of beef and pork?",
            (
                "How long should the sauce simmer? I was planning to make it Friday night after work, so maybe "
                "two hours at most."
            ),
            (
                "One guest is vegetarian. Could I make a small separate tray with spinach and ricotta, and would "
                "it need a different baking time?"
            ),
            "What about the bechamel, do I really need it if I'm already using ricotta in the meat one?",
            (
                "Can I assemble both trays on Friday and keep them in the fridge overnight, or will the noodles "
                "go soggy? My fridge is pretty full already, so I might have to leave one in a cool garage, which "
                "is around ten degrees at night."
            ),
            "Good to know. How long should they rest after coming out of the oven before I cut them?",
            "What would be a simple side dish that doesn't need the oven, since both lasagnas will be in there?",
            "Last thing: a dessert I can make Friday too. Something light, since lasagna is heavy.",
        ),
    ),
    Chat(
        "travel",
        (
            (
                "My partner and I are going to Japan for ten days in April. It's our first time, we like food, "
                "walking and old buildings more than nightlife or shopping, and we don't want to spend half the "
                "trip on trains. Where should we base ourselves?"
            ),
            "Is the Japan Rail Pass still worth it? I read the price went up a lot recently.",
            (
                "We land in Tokyo and fly out of Tokyo too. Would a Tokyo, Kyoto, Osaka loop make sense, and "
                "how many nights in each?"
            ),
            (
                "Cherry blossoms will probably be out. Are there places in Kyoto that are less crowded than the "
                "famous ones?"
            ),
            "What's the etiquette at temples and shrines? I don't want to do anything rude by accident.",
            "We'd love one night in a traditional inn with a hot spring. Is that doable as a side trip from Kyoto?",
            "How does money work there, can we use cards everywhere or should we carry cash?",
            (
                "My partner is vegetarian, and she doesn't eat fish either. I've read that a lot of broths and "
                "sauces are made with fish stock. Will she struggle to find food, especially outside the big "
                "cities, and is there a phrase she could show in restaurants?"
            ),
            "Any tips for the jet lag? We're flying from London and arrive in the afternoon.",
            "Finally, what's one thing most first-time visitors wish they had known before going?",
        ),
    ),
    Chat(
        "python code",
        (
            (
                "I have a folder with about 3,000 photos named like IMG_4821.JPG. I want to rename them by the "
                "date they were taken. Can Python do that?"
            ),
            "I installed Pillow. How do I read the date the photo was taken from the EXIF data?",
            "Some photos don't have EXIF at all, they come from WhatsApp. What should I fall back to?",
            (
                "If two photos were taken in the same second they'd get the same name. How do I avoid "
                "overwriting one with the other?"
            ),
            "Can you show the whole script put together, with a dry-run option that only prints what it would rename?",
            (
                "I ran the dry run and it got through about 400 files, then crashed with 'AttributeError: "
                "NoneType object has no attribute get' on a PNG file, a screenshot I think. The line it points to "
                "is the one that calls getexif. What's going on?"
            ),
            "That fixed it. It's quite slow though, about a minute for the whole folder. Is that normal?",
            "Could I also sort the renamed files into subfolders by year and month?",
            "How would I undo everything if I don't like the result? I should have thought of that first.",
            "Thanks. Last question: how do I turn this into a command I can run from anywhere on my Mac?",
        ),
    ),
    Chat(
        "history",
        (
            (
                "Why did the Western Roman Empire fall? I always hear different answers and I'm not sure which "
                "one is true."
            ),
            "You mention the economy. What actually went wrong with it, was it inflation?",
            "How important were the so-called barbarian invasions compared to problems inside the empire?",
            "Is it true that the Eastern half survived for another thousand years? Why did it do so much better?",
            (
                "What happened to ordinary people in Rome itself after 476? I imagine a farmer or a baker "
                "probably didn't notice that the last emperor had been deposed. Did life change overnight, or "
                "only over generations?"
            ),
            "I've heard some historians say there was no fall, only a transformation. What do they mean?",
            "Did lead pipes and lead poisoning really play a part, or is that a myth?",
            "How did Christianity fit into all this? Gibbon seems to blame it.",
            "Are there any good books on this for a non-specialist? I'd like something readable, not a textbook.",
            "If you had to sum up the whole thing in two sentences for a twelve-year-old, what would you say?",
        ),
    ),
    Chat(
        "sleep",
        (
            (
                "I've been having trouble sleeping for about a month. I fall asleep fine around eleven but wake up "
                "around 3am and can't get back to sleep, then I'm exhausted at work. Nothing big has changed in "
                "my life, although work has been a bit stressful lately."
            ),
            "I usually have a coffee around 3pm to get through the afternoon. Could that be part of it?",
            "What should I do when I wake up at 3am? Right now I just lie there and check my phone.",
            "Is melatonin safe to take every night? A friend swears by it.",
            "I also have a glass or two of wine most evenings to unwind. Does alcohol affect sleep that much?",
            "My bedroom gets quite warm. What temperature is best for sleeping?",
            "Would exercising in the evening help me sleep or make it worse? I can only go to the gym after work.",
            "I've read about sleep restriction therapy. What is it and is it something I could try on my own?",
            "At what point should I see a doctor about this rather than trying things myself?",
            "Thanks, this is helpful. Can you give me a short checklist I can stick on the fridge?",
        ),
    ),
    Chat(
        "cover letter",
        (
            (
                "I'm applying for a junior data analyst job at a logistics company and need to write a cover "
                "letter. I have no idea how to start."
            ),
            "My background is a degree in geography and two years working in a warehouse. Is that even relevant?",
            (
                "Here's my opening line: 'I am writing to apply for the position of Junior Data Analyst.' It "
                "sounds boring. Can you suggest something better?"
            ),
            (
                "I did a small project analysing delivery delays in Excel at my warehouse job. I pulled three "
                "months of dispatch times, found that most late orders came from one loading bay, and my manager "
                "changed the shift pattern because of it. How do I describe that so it sounds impressive but "
                "honest?"
            ),
            "The job ad asks for SQL, which I only know a little. Should I mention it or leave it out?",
            "How long should the whole letter be? Mine is currently almost two pages.",
            "Should I address it to 'Dear Hiring Manager' or try to find a name? The ad doesn't give one.",
            "Can you suggest a closing paragraph that doesn't sound desperate?",
            "Is it okay to use the same letter for other analyst jobs if I change the company name?",
            "One more: should I send it as a PDF or paste it into the email body?",
        ),
    ),
    Chat(
        "gardening",
        (
            (
                "I want to grow tomatoes on my balcony this summer. It faces south and gets sun most of the day. "
                "Where do I begin?"
            ),
            "Which varieties do well in pots? I'd like something for salads rather than big beefsteak ones.",
            "How big do the pots need to be? My balcony is small, so I can fit maybe four.",
            "Should I buy seedlings from the garden centre or start from seed indoors?",
            "How often should I water them? I'm away most weekends, which worries me.",
            "What about feeding, do they need fertiliser and which kind?",
            (
                "The lower leaves on one plant are turning yellow with brown spots, and it is spreading upwards "
                "slowly. The other three plants look fine so far. We had a week of rain just before it started. "
                "Is it a disease, and should I remove that plant before it spreads?"
            ),
            "Do I need to pinch out the side shoots? I've seen videos that say both yes and no.",
            "It's windy up there on the fourth floor. Will that be a problem and how do I support them?",
            "When the season ends, can I reuse the compost next year or should I throw it out?",
        ),
    ),
    Chat(
        "budget",
        (
            (
                "My partner and I want to save for a deposit on a flat in about three years. We've never really "
                "budgeted. How do we start?"
            ),
            (
                "We take home about 4,200 a month together. Rent is 1,400, bills and council tax about 350, the "
                "car around 300 with insurance, and food maybe 600. We also like to go away a couple of times a "
                "year. How much is realistic to save each month?"
            ),
            "I've heard of the 50/30/20 rule. Does it make sense for us, given rent is already a third?",
            "Where should we keep the savings? A normal savings account pays almost nothing.",
            "We also have a car loan at 7 percent with 5,000 left. Pay that off first or save?",
            (
                "What's the best way to track spending without it becoming a chore? We tried a spreadsheet once "
                "and gave up."
            ),
            "We spend a lot on takeaways, probably 300 a month. Any tips to cut down without feeling deprived?",
            "Should we have a joint account for everything or keep our own accounts too?",
            "How big should an emergency fund be, and should it be separate from the deposit savings?",
            "Can you summarise a simple monthly plan for us based on everything we discussed?",
        ),
    ),
    Chat(
        "running",
        (
            (
                "I'm 38, a bit overweight and haven't run since school. I'd like to be able to run a 5K by the "
                "autumn. Is that realistic?"
            ),
            "How many times a week should I run at the start? I don't want to injure myself.",
            "What should I wear on my feet? The shops push very expensive shoes.",
            (
                "I tried my first run yesterday and could only manage about two minutes before I had to walk, "
                "and my face went bright red. I did walk and jog in turns for twenty minutes in the end. Is that "
                "normal, or am I in worse shape than I thought?"
            ),
            "My shins hurt today. Should I rest or run through it?",
            "Should I run on the road, the treadmill at work, or the park paths? Does it matter?",
            "What should I eat before a morning run? If I eat anything I feel sick.",
            "I've been going for five weeks now and can run 15 minutes without stopping. How do I get to 30?",
            "There's a local 5K in October. Any advice for the race day itself?",
            "After the race, how do I keep motivated so I don't just stop again?",
        ),
    ),
    Chat(
        "leaky tap",
        (
            (
                "The kitchen tap has been dripping for a week and the sound is driving me mad. Is this something "
                "I can fix myself?"
            ),
            "It's a single lever mixer tap, not the old kind with two handles. Does that change anything?",
            "How do I turn the water off just for the tap? There are two small valves under the sink.",
            "I got the handle off but there's a cartridge inside that won't budge. What should I do?",
            "It finally came out. How do I find the right replacement cartridge? There's no brand name on it.",
            (
                "The hardware store has two that look almost the same, one is 35mm and one is 40mm. How do I "
                "check which I need?"
            ),
            (
                "New cartridge is in and the dripping has stopped, but now there's a small leak at the base of the "
                "tap whenever it's running. A little puddle forms around it on the worktop after a few minutes. "
                "What did I do wrong when I put it back together?"
            ),
            "That worked, it's dry now. Should I put plumber's tape on anything while it's apart?",
            "The water pressure seems lower than before. Could I have damaged something?",
            "Great, it was the aerator. How often should I clean it to stop this happening again?",
        ),
    ),
    Chat(
        "adopting a dog",
        (
            (
                "We're thinking of adopting a dog from a shelter. We live in a flat with a small garden and both "
                "work from home three days a week."
            ),
            "What size or type of dog would suit us? We'd like something calm but not too lazy.",
            "The shelter has a three-year-old greyhound mix. I've heard greyhounds sleep all day. Is that true?",
            "What should we have ready at home before we bring her back?",
            "How do we introduce her to our cat? The cat is ten and rather grumpy.",
            "What should the first week look like? I don't want to overwhelm her.",
            (
                "She has been with us for two weeks now and is lovely, but she seems anxious when we leave the room "
                "and cries at the door. On office days she would be alone for about six hours. How can we help "
                "her get used to being alone?"
            ),
            "How much exercise does she need? Can she be off the lead in the park?",
            "What about food? The shelter fed her dry food but the pet shop recommends raw.",
            "Any tips for finding a good vet? We've never had to choose one before.",
        ),
    ),
    Chat(
        "learning spanish",
        (
            (
                "I'm going to Spain next summer and want to learn some Spanish. I have about twenty minutes a day. "
                "What's the best approach?"
            ),
            "Are apps like Duolingo enough, or do I need a proper course?",
            "How do I practise speaking when I don't know any Spanish speakers?",
            "I keep mixing up ser and estar. Can you explain the difference simply?",
            "So why is it 'estoy cansado' but 'soy alto'? Both describe me.",
            "What are the most useful phrases for a tourist, things like ordering food or asking directions?",
            (
                "Is Spanish in Spain very different from Latin American Spanish? My app seems to teach the Mexican "
                "version, and a Spanish colleague laughed when I said a word I had learned there. Should I switch "
                "to something that teaches the Spanish of Spain, or does it not matter much for a tourist?"
            ),
            "How do I roll my Rs? I just can't do it and it's embarrassing.",
            "Can you recommend some Spanish TV shows that aren't too hard to follow with subtitles?",
            "If I keep this up for ten months, what level could I realistically reach?",
        ),
    ),
    Chat(
        "black holes",
        (
            "My daughter asked me what a black hole is and I realised I don't really know. Can you explain it simply?",
            "If nothing can escape, how do scientists know they exist at all?",
            "What happens if you fall into one? She was very excited about spaghettification.",
            "Is there a black hole at the centre of our galaxy? Could it ever swallow the Earth?",
            (
                "How did they take that picture of a black hole a few years ago? I remember it looked like a blurry "
                "orange doughnut. I thought you couldn't see them at all, so what exactly are we looking at in "
                "that image?"
            ),
            "What's the difference between a black hole and a neutron star?",
            "She asked if a black hole could turn into a white hole. Is that a real thing?",
            "What did Stephen Hawking discover about black holes? Something about them evaporating?",
            "Are there any good books or videos about space for a curious nine-year-old?",
            "Last one from her: if the sun became a black hole, what would happen to us?",
        ),
    ),
    Chat(
        "used car",
        (
            (
                "I need to buy a used car for about 8,000. Mostly city driving plus a long motorway trip once a "
                "month. Where should I start?"
            ),
            "Petrol, diesel or hybrid for my kind of driving? I've heard diesels don't like short trips.",
            "I found a 2017 hatchback with 70,000 miles and full service history. Is that mileage okay for the age?",
            "What should I check when I go to see it? I'm not mechanical at all.",
            "The seller says the cambelt was done at 60,000 but has no receipt for it. Should I worry?",
            "How do I check the car isn't stolen or still has finance owing on it?",
            "Is it better to buy from a dealer or a private seller at this price?",
            (
                "The test drive was fine around town, but there's a slight vibration through the steering wheel "
                "at motorway speed, around seventy. It goes away if I slow down. The seller said it just needs "
                "the wheels balancing. What could it be, and is he likely to be right?"
            ),
            "How much should I try to knock off the asking price, and how do I bring it up without being rude?",
            "If I buy it, what should I do in the first month of owning it?",
        ),
    ),
    Chat(
        "toddler tantrums",
        (
            (
                "My two-and-a-half-year-old has started having huge tantrums, mostly when we leave the "
                "playground or when I say no to something in a shop. He throws himself on the floor and screams "
                "for ten minutes or more. How should I handle them?"
            ),
            "Should I ignore the tantrum completely or try to comfort him? I've read both.",
            "He sometimes hits me when he's angry. What's the right response to that?",
            "Would giving a warning before we leave, like 'five more minutes', actually help at his age?",
            "Tantrums in the supermarket are the worst because everyone stares. Any tips for public meltdowns?",
            "My partner thinks we should use time-outs. Are they okay for a toddler?",
            "He's also been waking at night since the tantrums started. Could the two be connected?",
            "His nursery says he's fine there. Why is it only with us?",
            "How do I stay calm myself? Some days I'm close to shouting.",
            "When should I worry that it's more than a normal phase?",
        ),
    ),
    Chat(
        "interview prep",
        (
            (
                "I have my first software engineering interview next week, a video call with a technical round. "
                "How should I prepare in a week?"
            ),
            (
                "They said the technical part is 'problem solving in the language of your choice'. Should I use "
                "Python or Java?"
            ),
            "How do I practise thinking out loud? I tend to go silent when I'm concentrating.",
            "What if I get completely stuck on a problem? Is it over?",
            "Can you give me a typical easy problem so I can try it right now?",
            (
                "Here's my idea: loop over the list and for each number check every other number to see if the "
                "two add up to the target, and return the pair when I find one. It works on the example. Is that "
                "good enough, or will they expect something faster?"
            ),
            "Okay, the hash map version makes sense. How would I explain its time complexity?",
            "They'll probably ask 'tell me about yourself'. What should I say as a new graduate?",
            "What questions should I ask them at the end? I never know what to say.",
            "How soon should I follow up if I don't hear back?",
        ),
    ),
    Chat(
        "birthday party",
        (
            (
                "My son turns seven next month and wants a party for his whole class, which is 26 kids. I'm "
                "panicking slightly. Help?"
            ),
            "Should we do it at home or book a venue? Our house is not big and it'll probably rain.",
            "What kind of venues are good for this age? Soft play feels a bit young for seven.",
            (
                "He's obsessed with dinosaurs, especially the T. rex and anything with spikes. How could we make "
                "the party dinosaur-themed without spending a fortune? I'm reasonably crafty and have a couple "
                "of weekends to prepare things."
            ),
            "What games work for a big group of seven-year-olds that don't need much setting up?",
            "How much food do I need for 26 kids, and what do they actually eat at parties?",
            "Two children have nut allergies. How do I handle that safely?",
            "Party bags: are they still expected? They seem like plastic junk to me.",
            "How long should the party be? Two hours feels like a long time with that many kids.",
            "Any tips for the opening of presents? Last year it was chaos.",
        ),
    ),
    Chat(
        "book club",
        (
            (
                "I've just joined a book club and it's my turn to pick next month's book. The group likes "
                "literary fiction but not anything too bleak."
            ),
            "We read a lot of recent prize winners. Could you suggest something a bit older, maybe from the nineties?",
            "That sounds good. Is it very long? Some members complain about anything over 400 pages.",
            "What are some good discussion questions I could bring for it?",
            "One member always wants to talk about the film adaptation. Is there one?",
            "What else did the author write? In case people like it and want more.",
            (
                "The meeting went really well, thank you. For the next one, someone suggested we try a non-fiction "
                "book for a change, but the others worried it would feel like homework. Any non-fiction that "
                "reads like a novel?"
            ),
            "How do I keep the discussion going when people just say 'I liked it'?",
            "Our group meets in a pub. Is it silly to pick a drink or snack that matches the book?",
            "Could you make a short list of five backup picks in case they've all read my first choice?",
        ),
    ),
    Chat(
        "sql",
        (
            (
                "I have a table of orders with customer_id, order_date and amount. How do I get each customer's "
                "total spend for 2024?"
            ),
            "How do I show only customers who spent more than 1,000 in total?",
            "Now I want the top ten customers by spend, with their names from the customers table.",
            "Some customers have no orders in 2024 but I still want them in the list with zero. How?",
            "Why does COUNT(*) give 1 for those customers instead of 0 after the LEFT JOIN?",
            "Can I also get each customer's most recent order date in the same query?",
            (
                "The query works, but it takes about twenty seconds on our production database, which has around "
                "forty million orders and two million customers. It is PostgreSQL 15. What indexes would help, "
                "and is there anything else I should check first?"
            ),
            "What's the difference between putting the date condition in the WHERE clause and in the ON clause?",
            "How would I calculate the month-over-month change in total sales?",
            (
                "Last question: is this kind of query better done in SQL or should I pull the data into Python "
                "and use pandas?"
            ),
        ),
    ),
    Chat(
        "guitar",
        (
            "I'm 45 and just bought my first acoustic guitar. My fingertips hurt after ten minutes. Is that normal?",
            "How long should I practise each day as a beginner?",
            "Which chords should I learn first? I'd like to play some simple songs quickly.",
            "Switching from G to C takes me forever. Any tricks to change chords faster?",
            (
                "My strings buzz when I play the F chord, especially the top two. I press as hard as I can and "
                "my hand starts to cramp after a few tries. Is the guitar set up badly, or what am I doing wrong?"
            ),
            "Should I learn to read music or are tabs enough?",
            "Can you suggest a few easy songs that only use the chords I know?",
            "What's a good strumming pattern for those songs? I just go down every beat at the moment.",
            "Would lessons with a teacher be worth it, or can I learn from videos alone?",
            "When should I think about restringing it, and is that hard to do myself?",
        ),
    ),
)
"""The conversations, in a fixed order (the benchmark serves them round robin)."""


def messages(chat: Chat, turn: int, replies: Sequence[str]) -> list[dict[str, str]]:
    """The chat messages of turn ``turn`` (0-based) of ``chat``: the system prompt, every earlier
    user message with the reply to it (``replies[j]`` answered ``chat.turns[j]``), then this
    turn's user message. Raises ``ValueError`` unless there is exactly one reply per earlier turn.
    """
    if not 0 <= turn < len(chat.turns):
        raise ValueError(f"{chat.topic!r} has turns 0 to {len(chat.turns) - 1}, not {turn}")
    if len(replies) != turn:
        raise ValueError(f"turn {turn} of {chat.topic!r} needs {turn} earlier replies, got {len(replies)}")
    out = [{"role": "system", "content": SYSTEM}]
    for user, reply in zip(chat.turns, replies):
        out += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return out + [{"role": "user", "content": chat.turns[turn]}]


def render(tokenizer: Any, chat: Chat, turn: int, replies: Sequence[str]) -> list[int]:
    """The prompt token ids of turn ``turn`` (see :func:`messages`), rendered with the tokenizer's
    chat template and the generation prompt (the assistant's header) at the end."""
    ids = tokenizer.apply_chat_template(messages(chat, turn, replies), add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns an encoding (a mapping) by default
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def tokenizer(model_dir: Path | str) -> Any:
    """The tokenizer (with its chat template) of the model in ``model_dir``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
