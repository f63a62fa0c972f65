"""The English text the built-in tokenizer is trained on (written for this purpose)."""

CORPUS = """\
The morning market opened before the sun had cleared the hills. Farmers carried baskets of apples,
pears and plums to the long wooden tables, and the baker set out bread that was still warm. A child
asked her father why the river looked silver at dawn, and he told her that the water was only
borrowing the color of the sky. She thought about that for a long time.

A good server answers every request, even when the line is long. It keeps a queue, it measures how
long each step takes, and it tells you the truth when it is too busy. When a new request arrives, the
scheduler looks at the memory it has left, counts the blocks each sequence needs, and decides which
ones can run together. Prefill reads the whole prompt at once; decode writes one token at a time.

The library was quiet except for the turning of pages. An old man read about ships that crossed the
ocean with nothing but the stars to guide them. He remembered the first time he had seen the sea,
grey and enormous, and how small the harbor boats had seemed against it. Outside, the rain began
again, soft and steady, and the windows filled with the reflections of the lamps.

Numbers tell stories too. One, two, three, four, five, six, seven, eight, nine, ten. Twenty people
came to the meeting, forty chairs were set out, and half of them stayed empty. The budget was one
hundred and twelve dollars, the coffee cost eight, and the rest went to paper, pens and a new kettle.
In 2024 the team wrote 365 notes; in 2025 they wrote fewer notes but better ones.

How do you learn a new language? You listen, you repeat, you make mistakes and you laugh at them.
You learn the words for water, bread, friend and home. You learn to ask where the station is and how
much the ticket costs. Slowly the strange sounds become words, the words become sentences, and one
day you notice that you are thinking in the new language without trying.

The engineer opened her laptop and looked at the graph. Every time another user joined, each step
took a little longer, as if the machine were carrying one more stone up a hill. She drew a straight
line through the points and read its slope: thirty milliseconds per request. Then she asked the most
useful question in her field: where does the time actually go?

In the garden, the tomatoes ripened slowly under the summer heat. Bees moved from flower to flower,
and a cat slept in the shade of the fence. The gardener kept a notebook with the date of every
planting, the amount of water, and the first day each plant flowered. Patterns appeared after a few
seasons: early seeds in warm soil grew faster, and the plants near the wall needed less water.

Cooking is chemistry you can eat. Heat changes the shape of proteins, sugar turns brown and sweet,
and salt makes every flavor brighter. A simple soup needs onions, carrots, celery, a little oil,
water, and patience. Stir it, taste it, add pepper, and let it simmer until the kitchen smells like
home. Serve it with fresh bread and share it with someone you love.

Questions and answers. What is the capital of France? Paris. What color is the sky on a clear day?
Blue. How many days are in a week? Seven. Which is larger, an elephant or a mouse? An elephant. What
do plants need to grow? Light, water, air and soil. Who wrote the letter? The teacher wrote it.

The train left the city at noon and followed the river north. Fields of wheat gave way to forests,
and the forests gave way to mountains covered in snow. Passengers read, slept, played cards and
watched the changing view. At every station someone stepped off and someone else stepped on, each
carrying a different reason for the journey, each thinking the trip was the most important one.

Hello! How are you today? I am fine, thank you. Could you help me with a question? Of course, I
would be glad to help. Please explain the idea in simple words, and give me one short example. Here
is a short example: if you have three apples and you eat one, you have two apples left.

Weather report: clouds in the morning, sunshine in the afternoon, a light wind from the west, and a
chance of rain after dark. Temperatures will reach twenty degrees near the coast and fifteen in the
hills. Tomorrow will be colder, with frost in the valleys and clear skies over the northern islands.

Every system has limits. Memory is finite, time is finite, and attention is finite. A careful design
names each limit, checks it at the door, and explains clearly what happened when a limit is reached.
A careless design hides the limit until the worst possible moment, and then fails without a word.
"""
