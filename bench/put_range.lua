-- Workload of the embedded store's memory part: fenced PUTs over /accounts/0 .. /accounts/N-1
-- with a strictly increasing Fencing-Token, so every write is an admitted raise.
-- Arguments (after `--`): N, first token (bench/run passes the time in microseconds), order:
--   cycle    0, 1, ..., N-1, 0, ... (as bench/put.lua): with N within store.cache_size, every
--            write after the first round finds its resource cached;
--   scatter  a permutation of 0..N-1 (steps of a stride coprime with N): consecutive writes
--            land far apart in the file, and with N far above store.cache_size every write
--            finds its resource uncached (cold), until N writes have been sent.
-- Optional: LIMIT and MARKER, as in bench/fill.lua: after LIMIT responses, create MARKER and
-- stop (bench/run then ends wrk with SIGINT).
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "report.lua")

local resources, base, order, n, id, stride = 10000, 1, "cycle", 0, 0, 1
local limit, marker, got = nil, nil, 0
local body = '{"balance":100}\n'

local function gcd(a, b)
  while b ~= 0 do a, b = b, a % b end
  return a
end

init = function(args)
  resources = tonumber(args[1]) or resources
  base = tonumber(args[2]) or base
  order = args[3] or order
  limit = tonumber(args[4])
  marker = args[5]
  if order == "scatter" then
    -- Near the golden ratio of N, coprime with it: every id once per N writes.
    stride = math.floor(resources * 0.6180339887) + 1
    while gcd(stride, resources) ~= 1 do stride = stride + 1 end
  end
end

request = function()
  local token = base + n
  n = n + 1
  if order == "scatter" then
    id = (id + stride) % resources
  else
    id = n % resources
  end
  return wrk.format("PUT", "/accounts/" .. string.format("%.0f", id), {
    ["Fencing-Token"] = string.format("%.0f", token),
    ["Content-Type"] = "application/json",
  }, body)
end

response = function(status, headers, body)
  got = got + 1
  if limit and got == limit then
    if marker then
      local f = io.open(marker, "w")
      if f then f:write(got, "\n"); f:close() end
    end
    wrk.thread:stop()
  end
end
