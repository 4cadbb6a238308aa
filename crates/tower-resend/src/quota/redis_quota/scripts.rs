//! The two Lua scripts of a [`RedisQuota`](super::RedisQuota), each atomic
//! in Redis, each on the one key of the quota (a hash).
//!
//! The hash holds a field per quota (policy and partition), its value nine
//! numbers separated by spaces, times in Redis's clock (`TIME`), in
//! milliseconds since the epoch:
//!
//! | # | what |
//! |---|---|
//! | 1 | calls left before the reset: the last answer's count less the places taken since |
//! | 2 | the reset |
//! | 3 | the window stated (`w`), or -1 |
//! | 4 | the quota's size stated, or -1 |
//! | 5 | the most ever seen left of it |
//! | 6 | the longest reset seen, in ms |
//! | 7 | the pace's next slot (a GCRA's theoretical arrival time) |
//! | 8 | 1 when 1 and 2 are assumed at a reset, 0 when an answer said them |
//! | 9 | 1 when each call spends one of it (not a model API's tokens) |
//!
//! and the fields `!blocked`, a 429's `Retry-After` as a time, and
//! `!blind`, the calls that went before any answer was noted (until one
//! is). The rules
//! are the local ones ([`pace.rs`](super::super::pace)), written again in
//! Lua: what the layer keeps in memory, Redis keeps for every process.
//! Times are Redis's, never a process's: pods whose clocks disagree share
//! one reset. The scripts take durations (a reset, a deadline) relative to
//! the call, and answer durations.

/// Takes a call's place: `KEYS[1]` the quota's hash; `ARGV[1]` the burst,
/// `ARGV[2]` the call's time left in ms (-1: no deadline), `ARGV[3]` the
/// least time a wait must leave it. Answers `{0, ms}`: its place taken, at
/// `ms` from now (0: now); `{1, ms}`: a quota spent for `ms`, to ask again
/// then; `{2, ms}`: no room before the deadline, not taken; `{3, 0}`: Redis
/// knows nothing of the quota, and the call goes, counted in the field
/// `!blind` (calls that went before any answer was noted: the first
/// answer's count does not know of those still out, whichever process
/// sent them).
pub(super) const TAKE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local burst, time_left, min_left = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local all = redis.call('HGETALL', KEYS[1])
local blocked, qs = 0, {}
for i = 1, #all, 2 do
  if all[i] == '!blocked' then
    blocked = tonumber(all[i + 1]) or 0
  elseif all[i] == '!blind' then
    -- (counted below)
  else
    local v = {}
    for n in string.gmatch(all[i + 1], '%S+') do v[#v + 1] = tonumber(n) end
    if #v == 9 then qs[#qs + 1] = {all[i], v} end
  end
end
-- A wait must leave the call some time of its deadline.
local function fits(at)
  return at <= now or time_left < 0 or at - now + min_left <= time_left
end
-- The pace's interval for a call at `at`: the time left spread over the calls left.
local function interval(v, at)
  return math.floor(math.max(v[2] - math.max(v[7], at), 0) / math.max(v[1], 1))
end
local function save()
  local horizon = now + 1000
  for _, q in ipairs(qs) do
    local v = q[2]
    redis.call('HSET', KEYS[1], q[1], string.format('%d %d %d %d %d %d %d %d %d',
      v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9]))
    horizon = math.max(horizon, v[2] + math.max(v[3], v[6]))
  end
  redis.call('PEXPIRE', KEYS[1], math.max(horizon, blocked) - now)
end
if #qs == 0 and blocked <= now then
  -- Nothing known: the call goes, counted as gone blind (see NOTE).
  redis.call('HINCRBY', KEYS[1], '!blind', 1)
  if redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], 60000) end
  return {3, 0}
end
if blocked > now then
  if fits(blocked) then return {1, blocked - now} end
  return {2, blocked - now}
end
local spent, slot = nil, now
for _, q in ipairs(qs) do
  local v = q[2]
  -- Past its reset, the quota is whole again, until the next reset: whole
  -- windows after the last one.
  if now >= v[2] then
    v[1] = math.max(v[4] >= 0 and v[4] or v[5], 1)
    v[8] = 1
    v[7] = math.min(v[7], now)
    local w = math.max(v[3] >= 0 and v[3] or v[6], 1000)
    v[2] = v[2] + (math.floor((now - v[2]) / w) + 1) * w
    if v[2] <= now then v[2] = now + w end
  end
  if v[1] <= 0 then
    spent = math.max(spent or v[2], v[2])
  elseif v[9] == 1 then
    slot = math.max(slot, v[7] - interval(v, now) * burst)
  end
end
if spent then
  save()
  if fits(spent) then return {1, spent - now} end
  return {2, spent - now}
end
if not fits(slot) then
  save()
  return {2, slot - now}
end
for _, q in ipairs(qs) do
  local v = q[2]
  if v[9] == 1 then
    v[7] = math.max(v[7], slot) + interval(v, slot)
    v[1] = v[1] - 1
  end
end
save()
return {0, slot - now}
";

/// What an answer said: `KEYS[1]` the quota's hash; `ARGV[1]` the calls of
/// this process still out (the answer's count does not know of them),
/// `ARGV[2]` a 429's `Retry-After` in ms (-1: none), `ARGV[3]` the most
/// quotas kept, `ARGV[4]` how long ago its call went, in ms; then six per
/// quota: its field, 1 if each call spends one of it, what is left, the
/// reset in ms from now, its size (-1: not stated), its window in ms (-1:
/// not stated). An answer that may tell of the window before the one
/// Redis holds is left out: its window ends no earlier than its call went
/// plus its reset less a second (rounding), and unless that is past the
/// end of the window before (this one's reset less its stated window, of
/// more than a second), it may be that one, whose reset can fall within
/// a second of this one's in a
/// short window, and would make the quota whole too early (measured: two
/// processes met 429s one run in four before). In a window already
/// told of (its reset within a second of the answer's), the lowest count
/// and the earliest reset hold: every process's places are counted
/// already, and an answer that comes late says more is left than there
/// is. Else the answer says it.
pub(super) const NOTE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local pending, retry_after, most = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local sent = now - tonumber(ARGV[4])
local horizon = now + 1000
-- Calls that went before any answer was noted, from every process: all
-- but this one may still be out, and a new quota counts them as spent
-- (more than this process's own `pending`, which alone left two processes
-- 429s in their first window).
local blind = math.max(tonumber(redis.call('HGET', KEYS[1], '!blind') or '0') - 1, 0)
if retry_after >= 0 then
  local b = tonumber(redis.call('HGET', KEYS[1], '!blocked') or '0') or 0
  if now + retry_after > b then
    redis.call('HSET', KEYS[1], '!blocked', now + retry_after)
  end
  horizon = math.max(horizon, now + retry_after)
end
for i = 5, #ARGV, 6 do
  local field = ARGV[i]
  local calls, left = tonumber(ARGV[i + 1]), math.max(tonumber(ARGV[i + 2]) - pending, 0)
  local span = tonumber(ARGV[i + 3])
  local reset, limit, window = now + span, tonumber(ARGV[i + 4]), tonumber(ARGV[i + 5])
  local v = nil
  local old = redis.call('HGET', KEYS[1], field)
  if old then
    v = {}
    for n in string.gmatch(old, '%S+') do v[#v + 1] = tonumber(n) end
    if #v ~= 9 then v = nil end
  end
  if v == nil then
    if old or redis.call('HLEN', KEYS[1]) < most + 2 then
      v = {math.max(left - math.max(blind - pending, 0), 0), reset, -1, -1, 0, 0, now, 0, calls}
    end
  elseif v[3] > 1000 and sent + span - 1000 < v[2] - v[3] then
    v = nil
  elseif now < v[2] and math.abs(reset - v[2]) <= 1000 then
    v[1] = math.min(v[1], left)
    v[2] = math.min(v[2], reset)
    v[8] = 0
  else
    v[1], v[2], v[8] = left, reset, 0
    v[7] = math.min(v[7], reset)
  end
  if v then
    if limit >= 0 then v[4] = limit end
    v[5] = math.max(v[5], tonumber(ARGV[i + 2]))
    if window >= 0 then v[3] = window end
    v[6] = math.max(v[6], span)
    redis.call('HSET', KEYS[1], field, string.format('%d %d %d %d %d %d %d %d %d',
      v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9]))
    horizon = math.max(horizon, v[2] + math.max(v[3], v[6]))
  end
end
redis.call('HDEL', KEYS[1], '!blind')
local ttl = redis.call('PTTL', KEYS[1])
if ttl > -2 then
  redis.call('PEXPIRE', KEYS[1], math.max(horizon - now, ttl))
end
return 1
";
